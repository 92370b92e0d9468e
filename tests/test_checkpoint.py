"""Orbax checkpoints of the optimizer state: every field round-trips, and resuming is bit-exact.

* ``test_resume_in_a_fresh_process_is_bit_exact``: ``checkpoint_resume.py`` trains THOR on a
  small CNN with BatchNorm (MNIST digits) in one process and saves the train state with an orbax
  ``CheckpointManager`` after step 6 of 12; a second, fresh process restores it into the abstract
  target ``jax.eval_shape`` gives and runs steps 6 to 11. Both processes have this process's
  environment (four host CPU devices, ``conftest.py``).
* ``test_every_state_field_round_trips``: the fields the THOR run leaves empty (eigenvalues,
  stored factors, low-rank Woodbury form, adaptive intervals, embeddings' diagonal ``A``,
  LayerNorm's Fisher, the KL clip's state) hold arrays in a K-FAC and an SKFAC state; both are
  saved and restored in-process with ``StandardCheckpointer``.
"""

import os
import subprocess
import sys

from flax import serialization
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import checkpoint_resume as helper
import thor_optax
from thor_optax.flax import value_and_grad_with_stats
import reference
from reference import assert_orbax_round_trip

HELPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoint_resume.py")
# The processes import the thor_optax this process imported (a script's sys.path starts at its
# own directory, where an installed copy could shadow the checkout).
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(thor_optax.__file__)))


def _run(mode, workdir):
  env = dict(os.environ)  # XLA_FLAGS of conftest.py: four host devices, as in this process
  assert "--xla_force_host_platform_device_count=4" in env.get("XLA_FLAGS", "")
  env["PYTHONPATH"] = os.pathsep.join(
      [PACKAGE_ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
  proc = subprocess.run([sys.executable, HELPER, mode, str(workdir)], env=env,
                        capture_output=True, text=True, timeout=240)
  assert proc.returncode == 0, f"{mode} run failed:\n{proc.stdout}\n{proc.stderr}"


def _load(path):
  with np.load(path) as f:
    return {k: f[k] for k in f.files}


def _assert_identical(got, want, what):
  """Same tree structure, same leaves, dtypes and values bit for bit."""
  assert str(got.pop("treedef")) == str(want.pop("treedef")), f"{what}: tree structure differs"
  assert sorted(got) == sorted(want), f"{what}: leaves differ"
  for key in want:
    assert got[key].dtype == want[key].dtype, f"{what}: dtype of {key}"
    np.testing.assert_array_equal(got[key], want[key], err_msg=f"{what}: {key}")


def test_resume_in_a_fresh_process_is_bit_exact(tmp_path):
  checks = thor_optax.CheckSchedule(helper.CHECKS).check_steps(helper.STEPS)
  assert checks == [0, 2, 5, 9]  # checks before and after the checkpoint
  assert helper.SAVE_AT == 6
  helper.write_data(tmp_path / "data.npz")
  _run("full", tmp_path)
  _run("resume", tmp_path)

  saved, restored = _load(tmp_path / "saved.npz"), _load(tmp_path / "restored.npz")
  full, resumed = _load(tmp_path / "full.npz"), _load(tmp_path / "resumed.npz")
  # The checkpoint holds the whole train state: model, batch statistics, optimizer, step.
  for prefix in ("['params']['Head_0']['Dense_0']['kernel']",
                 "['batch_stats']['BatchNorm_0']['mean']",
                 "['opt_state'].inner_state[0].inner_state.blocks['b64']['inverse'].inverse",
                 "['opt_state'].inner_state[0].inner_state.layers['BatchNorm_0'].inverse",
                 "['opt_state'].inner_state[0].inner_state.diagnostics.counts",
                 "['opt_state'].inner_state[2][0].trace['Conv_0']['kernel']",
                 "['opt_state'].inner_state[2][1].count"):
    assert prefix in saved, prefix
  assert "KroneckerState" in str(saved["treedef"]) and "EmptyState" in str(saved["treedef"])
  assert int(saved["['step']"]) == helper.SAVE_AT and int(full["['step']"]) == helper.STEPS
  _assert_identical(dict(restored), dict(saved), "restored state")
  _assert_identical(dict(resumed), dict(full), "resumed run")

  # The steps after the checkpoint trained and refreshed curvature blocks (the check at 9).
  kernel = "['params']['Head_0']['Dense_0']['kernel']"
  assert np.abs(full[kernel] - saved[kernel]).max() > 1e-4
  # total_refreshes of every layer (Diagnostics.counts[:, 1]).
  refreshes = "['opt_state'].inner_state[0].inner_state.diagnostics.counts"
  assert np.any(full[refreshes][:, 1] > saved[refreshes][:, 1]), \
      "no block was refreshed after the checkpoint"
  assert int(full["['opt_state'].inner_state[2][1].count"]) == helper.STEPS  # learning-rate schedule


class _Tower(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.Dense(3)(nn.tanh(nn.Dense(40)(x)))


class _Net(nn.Module):
  """Embedding, LayerNorm and a submodule: the state's diagonal, unitwise and '/' keys."""

  @nn.compact
  def __call__(self, ids):
    x = nn.LayerNorm()(nn.Embed(11, 5)(ids))
    return _Tower()(x.mean(axis=1))


def test_every_state_field_round_trips(tmp_path):
  """Every field of ``KroneckerState`` holds arrays in one of these two states (a fresh state
  has them all; random values replace the zeros and identities), and all come back as saved."""
  params = _Net().init(jax.random.PRNGKey(0), jnp.zeros((2, 4), jnp.int32))["params"]
  optimizers = {
      # eigendecompositions, stored factors, adaptive intervals, inverse period, KL clip
      "kfac": optax.chain(
          thor_optax.scale_by_kl_clip(
              thor_optax.scale_by_kfac(inverse_method="eigh", ema_decay=0.9, inverse_period=3,
                                       adaptive_refresh=0.1, block_size=16), 0.1, 1e-3),
          optax.sgd(0.1, momentum=0.9)),
      # low-rank Woodbury form
      "skfac": thor_optax.skfac(0.1, woodbury_rows=8),
  }
  init = lambda p: {"params": p, "opt_state": {n: tx.init(p) for n, tx in optimizers.items()}}
  tree = jax.jit(init)(params)  # one compilation instead of one per eager op
  kfac = tree["opt_state"]["kfac"][0].inner_state
  skfac = reference.kronecker_state(tree["opt_state"]["skfac"])
  assert isinstance(kfac, thor_optax.KroneckerState)
  assert isinstance(skfac, thor_optax.KroneckerState)
  for field in thor_optax.KroneckerState._fields:
    if field == "factor_dims":  # no leaves: part of the structure, compared below
      continue
    assert jax.tree.leaves(getattr(kfac, field)) or jax.tree.leaves(getattr(skfac, field)), field
  # Dense_0 is Dense(3), built first, on 40 tanh units.
  assert dict(kfac.factor_dims.dims)["_Tower_0/Dense_0"] == (41, 3, 1)
  assert "_Tower_0/Dense_0" in kfac.diagnostics and not jax.tree.leaves(skfac.accumulator)  # '/', EmptyState

  rng = np.random.default_rng(0)

  def randomize(x):
    if x.dtype == np.bool_:
      return jnp.asarray(rng.random(x.shape) < 0.5)
    if jnp.issubdtype(x.dtype, jnp.integer):
      return jnp.asarray(rng.integers(0, 1000, x.shape), x.dtype)
    return jnp.asarray(rng.standard_normal(x.shape), x.dtype)

  tree = jax.tree.map(randomize, tree)
  target = jax.eval_shape(init, params)
  assert_orbax_round_trip(tree, target, tmp_path / "state")  # structure: factor_dims too
  # Flax's msgpack (flax.training.checkpoints, TrainState): the same leaves, factor_dims kept.
  restored = serialization.from_bytes(init(params), serialization.to_bytes(tree))
  assert jax.tree.structure(restored) == jax.tree.structure(tree)
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(tree)):
    np.testing.assert_array_equal(got, want)


def test_a_state_restored_as_numpy_steps_eagerly():
  """Flax's msgpack (and ``jax.device_get``) give back numpy arrays: an eager (not jitted) check
  step on them gives the step of the state they came from. SKFAC's Woodbury refresh from the
  rows and the batched refresh wrote into the state with ``.at[...]``, which numpy lacks."""
  model = nn.Sequential([nn.Dense(8), jnp.tanh, nn.Dense(3)])
  x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 5)))
  params = model.init(jax.random.PRNGKey(0), x)["params"]
  (_, grads), stats = value_and_grad_with_stats(model, reference.softmax_ce)(
      params, x, jnp.arange(4) % 3)
  tx = thor_optax.skfac(0.1)
  _, state = tx.update(grads, tx.init(params), params, curvature_stats=stats)
  restored = serialization.from_bytes(state, serialization.to_bytes(state))
  assert isinstance(jax.tree.leaves(restored)[-1], np.ndarray)
  want = tx.update(grads, state, params, curvature_stats=stats)
  got = tx.update(grads, restored, params, curvature_stats=stats)
  jax.tree.map(np.testing.assert_array_equal, got, want)
