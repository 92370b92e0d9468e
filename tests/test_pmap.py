"""Data parallelism with ``jax.pmap``: ``axis_name`` averages the curvature across replicas.

The training step is pmapped as Flax's ImageNet example does (``jax.pmap(step,
axis_name='batch')``, gradients and loss ``jax.lax.pmean``-ed in the step), on 2 of the 4 host
CPU devices of the test processes (``conftest.py``). With ``axis_name='batch'`` the two
replicas' parameters and optimizer states stay identical bit for bit over check and plain steps
(a plain step in sample space too: each replica's product of rows, averaged across replicas),
and equal, in float64, one device training on the concatenated batch; for THOR (trace rule,
blocks of 8), K-FAC (running average, inverse period), SKFAC (low-rank Woodbury forms inverted
from the gathered rows, Cholesky for the others) and SP-NGD (adaptive refresh, pi damping), on a
model with an ``nn.Embed`` (diagonal ``A``), dense layers and a cross-replica ``nn.BatchNorm``
(unit-wise Fisher). Without ``axis_name`` a check step inside ``pmap`` raises; with an axis that
is not bound, too; ``woodbury_rows`` counts the rows of every replica.
"""

import functools
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import thor_optax
from thor_optax.flax import value_and_grad_with_stats
from reference import float64_mode  # noqa: F401  pylint: disable=unused-import (autouse fixture)
from reference import F64, init_params, softmax_ce

pytestmark = pytest.mark.usefixtures("fast_compiles")

REPLICAS = 2
N = 4  # examples per replica
T = 3  # tokens per example
VOCAB = 11
CLASSES = 6  # Dense_1's G: 4 rows per replica < 6 <= 8 rows in all (SKFAC's 'auto': Cholesky)
# "sample": a plain step preconditioned in sample space from its batch's rows
# (gradient_stats=): each replica's product of rows, averaged across replicas.
STEPS = ("check", "plain", "check", "check", "sample", "check")
LR, LAM = 0.2, 0.03
# One device sums the whole batch in another order than two replicas plus an all-reduce.
TOL = 1e-10
# Each program runs a few times: compile without XLA's backend optimizations (test_registries).
FAST_COMPILE = dict(xla_backend_optimization_level=0, xla_llvm_disable_expensive_passes=True)

CONFIGS = {
    "thor": lambda axis: thor_optax.thor(LR, LAM, block_size=8, trace_thresholds=(0.3, 0.0),
                                         axis_name=axis),
    "kfac": lambda axis: thor_optax.kfac(LR, LAM, ema_decay=0.9, inverse_period=2,
                                         axis_name=axis),
    "skfac": lambda axis: thor_optax.skfac(LR, LAM, woodbury_rows=REPLICAS * N, axis_name=axis),
    "spngd": lambda axis: thor_optax.spngd(LR, LAM, adaptive_refresh=0.5, axis_name=axis),
}


class Net(nn.Module):
  """Embed -> Dense(16) -> BatchNorm (training mode, across ``bn_axis``) -> tanh -> Dense."""

  bn_axis: Optional[str] = None

  @nn.compact
  def __call__(self, ids):
    kw = dict(dtype=F64, param_dtype=F64)
    h = nn.Embed(VOCAB, 6, **kw)(ids).reshape(ids.shape[0], -1)
    h = nn.Dense(16, **kw)(h)
    h = nn.BatchNorm(use_running_average=False, axis_name=self.bn_axis, **kw)(h)
    return nn.Dense(CLASSES, **kw)(jnp.tanh(h))


def _data():
  """``(ids (steps, replicas, N, T), labels (steps, replicas, N))``."""
  rng = np.random.default_rng(0)
  ids = rng.integers(0, VOCAB, (len(STEPS), REPLICAS, N, T)).astype(np.int32)
  return jnp.asarray(ids), jnp.asarray(rng.integers(0, CLASSES, (len(STEPS), REPLICAS, N)))


def _init():
  ids, _ = _data()
  model = Net()
  params = init_params(model, ids[0, 0], seed=1)
  variables = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), ids[0, 0]))
  batch_stats = jax.tree.map(lambda s: jnp.zeros(s.shape, F64), variables["batch_stats"])
  return params, {"batch_stats": batch_stats}


def _step_fns(tx, axis):
  """``{kind: step}`` for the kinds of ``STEPS``: ``(params, opt_state, model_state, ids,
  labels) -> (params, opt_state, loss)``, gradients and loss ``pmean``-ed over ``axis`` when it
  is set."""
  capture = value_and_grad_with_stats(Net(bn_axis=axis), softmax_ce)

  def step(params, opt_state, model_state, ids, labels, stats_as):
    (loss, grads), stats, _ = capture(params, ids, labels, model_state=model_state,
                                      mutable=["batch_stats"])
    if axis is not None:
      grads, loss = jax.lax.pmean((grads, loss), axis)
    extra = {stats_as: stats} if stats_as else {}
    updates, opt_state = tx.update(grads, opt_state, params, **extra)
    return optax.apply_updates(params, updates), opt_state, loss

  kinds = {"check": "curvature_stats", "plain": None, "sample": "gradient_stats"}
  if axis is None:
    mapped = {k: jax.jit(functools.partial(step, stats_as=s)) for k, s in kinds.items()}
  else:
    mapped = {k: jax.pmap(functools.partial(step, stats_as=s), axis_name=axis,
                          devices=jax.devices()[:REPLICAS]) for k, s in kinds.items()}
  return {k: _compiled_once(f) for k, f in mapped.items()}


def _compiled_once(mapped):
  """``mapped`` compiled with ``FAST_COMPILE`` at its first call, that program afterwards."""
  program = []

  def call(*args):
    if not program:
      program.append(mapped.lower(*args).compile(compiler_options=FAST_COMPILE))
    return program[0](*args)

  return call


def _train(name, axis):
  """Trains ``STEPS``; with ``axis`` pmapped over the replicas' shards, else on one device over
  the concatenated batches. Returns ``(params, opt_state, losses)`` (per replica with ``axis``)."""
  ids, labels = _data()
  params, model_state = _init()
  tx = CONFIGS[name](axis)
  opt_state = tx.init(params)
  steps = _step_fns(tx, axis)
  if axis is not None:
    params, opt_state, model_state = jax.tree.map(
        lambda a: jnp.stack([a] * REPLICAS), (params, opt_state, model_state))
  else:
    ids, labels = (a.reshape((a.shape[0], REPLICAS * N) + a.shape[3:]) for a in (ids, labels))
  losses = []
  for i, kind in enumerate(STEPS):
    params, opt_state, loss = steps[kind](params, opt_state, model_state, ids[i], labels[i])
    losses.append(loss)
  return params, opt_state, np.asarray(losses)


def _max_difference(a, b):
  return max((float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
              for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)) if np.size(x)),
             default=0.0)


def _inner(opt_state):
  """The :class:`thor_optax.KroneckerState` inside an alias's chain (and KL clip)."""
  return next(s for s in jax.tree.leaves(
      opt_state, is_leaf=lambda s: isinstance(s, thor_optax.KroneckerState))
              if isinstance(s, thor_optax.KroneckerState))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_replicas_agree_and_equal_one_device_on_the_whole_batch(name):
  params, opt_state, losses = _train(name, "batch")
  one_params, one_state, one_losses = _train(name, None)
  replica = [jax.tree.map(lambda a, r=r: a[r], (params, opt_state)) for r in range(REPLICAS)]
  # (1) the replicas are identical, bit for bit, parameters and curvature state alike.
  jax.tree.map(np.testing.assert_array_equal, replica[0], replica[1])
  # (2) and equal one device on the concatenated batch (float64).
  assert jax.tree.structure(replica[0]) == jax.tree.structure((one_params, one_state))
  assert _max_difference(replica[0], (one_params, one_state)) < TOL
  np.testing.assert_allclose(losses[:, 0], one_losses, rtol=0, atol=TOL)
  assert _max_difference(one_params, _init()[0]) > 0.1  # the steps did move the parameters
  state = _inner(replica[0][1])
  for layer in ("Embed_0", "Dense_0", "Dense_1"):
    assert int(state.diagnostics[layer].total_refreshes) > 0, layer
  assert "BatchNorm_0" in state.layers  # the unit-wise Fisher of the normalization layer
  assert not np.allclose(np.asarray(state.layers["BatchNorm_0"].inverse),
                         np.eye(2)), "the normalization layer's curvature was never refreshed"
  if name == "skfac":  # Dense_0's A (19) and G (16), Dense_1's A (17): low-rank, from rows
    assert sorted(g for g in state.blocks if "r" in g) == ["b16r8", "b17r8", "b19r8"]
  if name in ("thor", "spngd"):  # the trace rule / adaptive refresh skipped some blocks
    refreshes = sum(int(d.total_refreshes) for d in state.diagnostics.values())
    blocks = sum(int(d.num_blocks) for d in state.diagnostics.values())
    assert 0 < refreshes < STEPS.count("check") * blocks


# ------------------------------------------------------------------------------------------------
# Errors: raised while the check step is traced, before anything is compiled.


class _Small(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.Dense(3, dtype=F64, param_dtype=F64)(x)


def _small_check(tx, stats_as="curvature_stats"):
  """A pmappable check step of one dense layer (``A`` of dimension 17, ``G`` of 3), and its
  replicated inputs (``stats_as="gradient_stats"``: a plain step from the rows)."""
  model = _Small()
  x = jnp.asarray(np.random.default_rng(2).standard_normal((REPLICAS, N, 16)))
  y = jnp.asarray(np.arange(REPLICAS * N).reshape(REPLICAS, N) % 3, jnp.int32)
  params = init_params(model, x[0])
  capture = value_and_grad_with_stats(model, softmax_ce)

  def check(params, state, x, y):
    (_, grads), stats = capture(params, x, y)
    return tx.update(grads, state, params, **{stats_as: stats})

  replicated = jax.tree.map(lambda a: jnp.stack([a] * REPLICAS), (params, tx.init(params)))
  return check, (*replicated, x, y)


def _pmap(fn, **kw):
  return jax.pmap(fn, devices=jax.devices()[:REPLICAS], **kw)


@pytest.mark.parametrize("alias", ["thor", "kfac", "skfac", "kaisa", "spngd"])
def test_pmap_without_axis_name_raises(alias):
  check, args = _small_check(getattr(thor_optax, alias)(0.1))
  with pytest.raises(ValueError, match=r"thor_optax: .*\['batch'\].*Pass axis_name='batch'"):
    _pmap(check, axis_name="batch")(*args)


def test_pmap_with_an_unnamed_axis_raises():
  check, args = _small_check(thor_optax.scale_by_thor())
  with pytest.raises(ValueError, match=r"thor_optax: .*jax.pmap\(\.\.\., axis_name='batch'\)"):
    _pmap(check)(*args)


def test_axis_name_that_is_not_bound_raises():
  check, args = _small_check(thor_optax.scale_by_kfac(axis_name="batch"))
  unreplicated = jax.tree.map(lambda a: a[0], args)
  with pytest.raises(ValueError, match=r"axis_name='batch', but no mapped axis 'batch' is bound"):
    jax.jit(check)(*unreplicated)
  with pytest.raises(ValueError, match=r"no mapped axis 'batch' is bound.*bound: \['data'\]"):
    _pmap(check, axis_name="data")(*args)
  # A plain step from the rows averages across the axis too (a NameError deep in JAX before).
  plain, args = _small_check(thor_optax.thor(0.1, axis_name="batch"), "gradient_stats")
  with pytest.raises(ValueError, match=r"no mapped axis 'batch' is bound where a plain step "
                                       r"from the rows"):
    jax.jit(plain)(*jax.tree.map(lambda a: a[0], args))


def test_axis_name_empty_keeps_each_replicas_curvature():
  """``axis_name=()``: no averaging and no error; the replicas' curvature differs (what
  ``axis_name`` prevents)."""
  check, args = _small_check(thor_optax.scale_by_thor(axis_name=()))
  _, state = _pmap(check, axis_name="batch")(*args)
  inverse = np.asarray(state.blocks["b32"]["inverse"].inverse)
  assert np.max(np.abs(inverse[0] - inverse[1])) > 1e-3


def test_woodbury_rows_count_the_rows_of_every_replica():
  """4 rows per replica, 8 in all: a low-rank state for 4 rows does not hold them."""
  check, args = _small_check(thor_optax.scale_by_kfac(
      ema_decay=None, inverse_method="low_rank", woodbury_rows=N, axis_name="batch"))
  with pytest.raises(ValueError, match=rf"has {REPLICAS * N} rows.*woodbury_rows={N}"):
    _pmap(check, axis_name="batch")(*args)


def test_invalid_axis_name_options():
  with pytest.raises(ValueError, match="axis_name must be None, the name of the mapped axis"):
    thor_optax.scale_by_thor(axis_name=0)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:REPLICAS]), ("data",))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  with pytest.raises(ValueError, match="axis_name='batch' and block_sharding cannot be combined"):
    thor_optax.thor(0.1, axis_name="batch", block_sharding=sharding)


class _ConstantInput(nn.Module):
  """A dense layer on the input, and one on a row that is the same for every example."""

  @nn.compact
  def __call__(self, x):
    kw = dict(dtype=F64, param_dtype=F64)
    same = jnp.broadcast_to(jnp.linspace(0.5, 1.5, 4), (x.shape[0], 4))
    return nn.Dense(3, **kw)(jnp.tanh(nn.Dense(6, **kw)(x))) + nn.Dense(3, **kw)(same)


def test_one_example_per_replica_rejects_a_repeated_row_as_one_device_does():
  """One device sees the constant layer's two identical rows and keeps its ``A`` (a rank-one
  ``A`` says nothing of the inputs' spread); with one row per replica that rule was skipped
  (each replica counted its own single row), ``A`` refreshed, and the update was 73% off."""
  model = _ConstantInput()
  x = jnp.asarray(np.random.default_rng(3).standard_normal((REPLICAS, 1, 7)))
  y = jnp.asarray([[0], [2]], jnp.int32)
  params = init_params(model, x[0])
  capture = value_and_grad_with_stats(model, softmax_ce)

  def check(tx, axis):
    def step(params, state, x, y):
      (_, grads), stats = capture(params, x, y)
      if axis:
        grads = jax.lax.pmean(grads, axis)
      return tx.update(grads, state, params, curvature_stats=stats)[0]
    return step

  tx = thor_optax.kfac(0.1, 0.03, ema_decay=None, axis_name="batch")
  replicated = jax.tree.map(lambda a: jnp.stack([a] * REPLICAS), (params, tx.init(params)))
  got = _pmap(check(tx, "batch"), axis_name="batch")(*replicated, x, y)
  one = thor_optax.kfac(0.1, 0.03, ema_decay=None)
  want = jax.jit(check(one, None))(params, one.init(params), x.reshape(REPLICAS, 7),
                                   y.reshape(REPLICAS))
  assert _max_difference(jax.tree.map(lambda a: a[0], got), want) < TOL
  assert _max_difference(jax.tree.map(lambda a: a[1], got), want) < TOL
