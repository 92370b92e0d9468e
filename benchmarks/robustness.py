"""How often each alias goes non-finite or diverges on a learning-rate x damping grid.

Users tune the learning rate and the damping on a grid; an optimizer that blows up on much of it
gets dropped. For every second-order alias of ``thor_optax`` (its defaults otherwise, its check
schedule of ``benchmarks/mnist.py``), SGD-momentum and Adam, this trains a model of
``benchmarks/mnist.py`` on the first ``--digits`` training digits (batch ``--batch-size``,
``--steps`` steps, the same init and batches for every run) at every learning rate of
``--learning-rates`` and every damping of ``--dampings``, and counts per alias:

* ``skipped``: runs in which the alias's non-finite guard (``thor_optax.skip_not_finite``, in
  every alias) skipped at least one step, with the number of steps it skipped in all;
* ``non-finite``: runs whose parameters or final training loss are not finite;
* ``diverged``: runs whose mean training loss over the last 10 steps is finite and above the
  loss at the first step (a finite blow-up; a non-finite run counts as non-finite only).

Each alias's step functions compile once per model: the learning rate and the damping enter as
traced scalars (constant schedules built inside the jitted steps), so the grid costs only its
steps.

Run (defaults: the MLP of ``mnist.py``, 1,000 digits, batch 100, 300 steps, learning rates
0.003-0.3 x damping 1e-4-0.1, the five aliases, SGD and Adam)::

  python3 benchmarks/robustness.py
  python3 benchmarks/robustness.py --task cnn --steps 150 --aliases thor kfac
  python3 benchmarks/robustness.py --aliases skfac --seed 0 1 2   # one grid per seed

The table ends with the highest of the runs' last-10 losses (``nan`` when one is not finite).
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import thor_optax
import thor_optax.flax

import mnist  # benchmarks/mnist.py, beside this script
import options

ALIASES = ("thor", "kfac", "skfac", "kaisa", "spngd")
FIRST_ORDER = {"sgd": lambda lr: optax.sgd(lr, momentum=0.9), "adam": optax.adam}


def make_tx(name: str, learning_rate, damping, batch_size: int) -> optax.GradientTransformation:
  """The alias ``name`` at a (traced) learning rate and damping, its other settings as in
  ``benchmarks/mnist.py``; ``'sgd'``: optax SGD with momentum 0.9, ``'adam'``: optax Adam (no
  damping)."""
  lr = lambda _: learning_rate  # constant schedules: the values may be traced
  if name in FIRST_ORDER:
    return FIRST_ORDER[name](lr)
  kwargs = {"thor": dict(block_size=128), "skfac": dict(woodbury_rows=batch_size)}.get(name, {})
  return getattr(thor_optax, name)(lr, lambda _: damping, **kwargs)


def grid_runs(model, variables, name: str, data: mnist.Split, batches: list, checks,
              grid: list, batch_size: int) -> list:
  """Trains ``name`` at every ``(learning_rate, damping)`` of ``grid``; one record per run."""
  capture = thor_optax.flax.value_and_grad_with_stats(model, mnist.loss_fn)
  params = variables["params"]
  template = make_tx(name, 0.1, 0.03, batch_size)

  def apply(p, x):
    return model.apply({"params": p}, x, train=True)

  @jax.jit
  def check_step(params, state, x, y, lr, damping):
    (loss, grads), stats = capture(params, x, y, train=True)
    updates, state = make_tx(name, lr, damping, batch_size).update(
        grads, state, params, curvature_stats=stats)
    return optax.apply_updates(params, updates), state, loss

  @jax.jit
  def plain_step(params, state, x, y, lr, damping):
    loss, grads = jax.value_and_grad(lambda p: mnist.loss_fn(apply(p, x), y))(params)
    updates, state = make_tx(name, lr, damping, batch_size).update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  schedule = options.check_schedule(checks) if checks is not None else None
  records = []
  for lr, damping in grid:
    p, state = params, template.init(params)
    losses = []
    for step, idx in enumerate(batches):
      check = schedule is not None and schedule(step)
      fn = check_step if check else plain_step
      p, state, loss = fn(p, state, jnp.asarray(data.x[idx]), jnp.asarray(data.y[idx]),
                          jnp.float32(lr), jnp.float32(damping))
      losses.append(float(loss))
    skipped = optax.tree_utils.tree_get(state, "total_notfinite")
    finite = all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(p))
    last = float(np.mean(losses[-10:]))
    records.append(dict(
        optimizer=name, learning_rate=lr, damping=damping if name in ALIASES else None,
        skipped_steps=int(skipped) if skipped is not None else 0,
        non_finite=not (finite and math.isfinite(last)),
        # A run that went non-finite is counted there only (nan <= x is False).
        diverged=math.isfinite(last) and last > losses[0], first_loss=losses[0],
        final_loss=last))
    print(f"  {name:5s} lr={lr:<6g} damping={damping:<7g} first {losses[0]:.3f} "
          f"last-10 {last:.4g} skipped {records[-1]['skipped_steps']}", flush=True)
  return records


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--task", choices=("mlp", "cnn"), default="mlp")
  p.add_argument("--aliases", nargs="+", choices=ALIASES + tuple(FIRST_ORDER),
                 default=list(ALIASES) + list(FIRST_ORDER))
  p.add_argument("--digits", type=int, default=1000, help="(default: %(default)s)")
  p.add_argument("--batch-size", type=int, default=100, help="(default: %(default)s)")
  p.add_argument("--steps", type=int, default=300, help="(default: %(default)s)")
  p.add_argument("--learning-rates", type=float, nargs="+", default=[0.003, 0.01, 0.03, 0.1, 0.3])
  p.add_argument("--dampings", type=float, nargs="+", default=[1e-4, 1e-3, 1e-2, 1e-1])
  p.add_argument("--seed", type=int, nargs="+", default=[0],
                 help="seeds of the initial parameters and of the batch order, one grid each "
                      "(default: %(default)s)")
  options.add_lapack_threads_option(p)
  args = p.parse_args(argv)
  options.apply_lapack_threads(args)

  train_set, _ = mnist.load_mnist()
  data = mnist.Split(train_set.x[:args.digits], train_set.y[:args.digits])
  model = mnist.MODELS[args.task]()
  rows = []
  for seed in args.seed:
    variables = mnist.init_variables(model, data.x[:1], seed)
    batches = mnist.batch_order(args.digits, args.batch_size, args.steps, seed)
    print(f"{args.task}: {args.digits} digits, batch {args.batch_size}, {args.steps} steps, "
          f"seed {seed}; "
          f"jax {jax.__version__}, {jax.devices()[0].platform}, {os.cpu_count()} CPU cores")
    for name in args.aliases:
      start = time.perf_counter()
      dampings = args.dampings if name in ALIASES else [0.0]
      grid = list(itertools.product(args.learning_rates, dampings))
      records = grid_runs(model, variables, name, data, batches, mnist.DEFAULT_CHECKS.get(name),
                          grid, args.batch_size)
      rows.append((name, seed, len(records), sum(r["skipped_steps"] > 0 for r in records),
                   sum(r["skipped_steps"] for r in records),
                   sum(r["non_finite"] for r in records), sum(r["diverged"] for r in records),
                   float(np.max([r["final_loss"] for r in records])), time.perf_counter() - start))
  print(f"\n{'optimizer':>9}  {'seed':>4}  {'runs':>4}  {'skipped runs':>12}  "
        f"{'skipped steps':>13}  {'non-finite':>10}  {'diverged':>8}  {'highest last-10':>15}  "
        f"{'seconds':>7}")
  for name, seed, n, sk_runs, sk_steps, nonfinite, diverged, highest, seconds in rows:
    print(f"{name:>9}  {seed:>4}  {n:>4}  {sk_runs:>12}  {sk_steps:>13}  {nonfinite:>10}  "
          f"{diverged:>8}  {highest:>15.4g}  {seconds:>7.0f}")


if __name__ == "__main__":
  main()
