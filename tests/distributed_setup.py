"""A small conv + MLP problem trained a few THOR steps on a device mesh, in-process or as one of
several ``jax.distributed`` processes (``python3 distributed_setup.py PROCESS_ID PORT OUT``).

Layout with 16-blocks: the ``b16`` group holds 16 blocks (conv ``A``: 2, ``Dense_0``: 7 + 2,
``Dense_1`` ``A``: 3, and the two 3-dimensional ``G`` of the conv and ``Dense_1``, each padded to
a block of 16: two small factors next to 14 full blocks), so it shards evenly over 1, 2, 4 or 8
devices.
"""

import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import thor_optax
from thor_optax.flax import value_and_grad_with_stats

BATCH = 16
STEPS = ("check", "plain", "check")


class Net(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(3, (3, 3))(x))
    x = nn.relu(nn.Dense(32)(x.reshape(x.shape[0], -1)))
    return nn.Dense(3)(x)


def loss_fn(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def data():
  """The global batches of every step: ``[(x (16, 6, 6, 2), y (16,)), ...]``."""
  rng = np.random.default_rng(0)
  return [(rng.standard_normal((BATCH, 6, 6, 2)).astype(np.float32),
           rng.integers(0, 3, BATCH).astype(np.int32)) for _ in STEPS]


def optimizer(block_sharding=None):
  return thor_optax.thor(0.1, 0.03, block_size=16, trace_thresholds=(0.0, 0.0),
                         block_sharding=block_sharding)


def train(mesh=None, block_axis=None, distribute_inversion=False, put=jax.device_put):
  """Trains ``STEPS`` from a fixed init; returns ``(params, opt_state)``.

  Without a mesh: one device. With one: the batch is sharded over the mesh axis ``'data'``,
  parameters are replicated, the optimizer state is laid out by
  ``kronecker_state_sharding(..., block_axis)``, and ``distribute_inversion`` shards every block
  stack over ``'data'`` before it is inverted. ``put(array, sharding)`` places each global array
  (several processes pass one that builds it from their local part).
  """
  model = Net()
  batches = data()
  params = model.init(jax.random.PRNGKey(1), batches[0][0])["params"]
  tx = optimizer(NamedSharding(mesh, P("data")) if distribute_inversion else None)
  opt_state = tx.init(params)
  capture = value_and_grad_with_stats(model, loss_fn)

  def check(params, opt_state, x, y):
    (_, grads), stats = capture(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params, curvature_stats=stats)
    return optax.apply_updates(params, updates), opt_state

  def plain(params, opt_state, x, y):
    grads = jax.grad(lambda p: loss_fn(model.apply({"params": p}, x), y))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  if mesh is None:
    steps = {"check": jax.jit(check), "plain": jax.jit(plain)}
    for kind, (x, y) in zip(STEPS, batches):
      params, opt_state = steps[kind](params, opt_state, x, y)
    return params, opt_state
  rep, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  state_sharding = thor_optax.kronecker_state_sharding(opt_state, mesh, block_axis)
  shardings = dict(in_shardings=(rep, state_sharding, batch, batch),
                   out_shardings=(rep, state_sharding))
  steps = {"check": jax.jit(check, **shardings), "plain": jax.jit(plain, **shardings)}
  params = jax.tree.map(lambda a: put(a, rep), params)
  opt_state = jax.tree.map(put, opt_state, state_sharding)
  for kind, (x, y) in zip(STEPS, batches):
    params, opt_state = steps[kind](params, opt_state, put(x, batch), put(y, batch))
  return params, opt_state


def _worker(process_id: int, port: int, out: str, num_processes: int = 2) -> None:
  """One of ``num_processes`` processes: one CPU device each, THOR with distributed inversion."""
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                             num_processes=num_processes, process_id=process_id)
  mesh = Mesh(np.array(jax.devices()), ("data",))
  rows = BATCH // num_processes

  def put(array, sharding):
    """A global array from this process's part: its rows of a batch, or all of a replica."""
    array = np.asarray(array)
    if sharding.spec == P("data"):
      array = array[process_id * rows:(process_id + 1) * rows]
    return jax.make_array_from_process_local_data(sharding, array)

  params, _ = train(mesh, distribute_inversion=True, put=put)
  leaves = {jax.tree_util.keystr(path): np.asarray(leaf.addressable_data(0))
            for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
  np.savez(out, **leaves)
  jax.distributed.shutdown()


if __name__ == "__main__":
  _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
