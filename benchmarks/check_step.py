"""THOR's per-step costs: skipped blocks, the hardware-driven block size, the plain step's forms.

Three tables per model (the MLP and the CNN of ``benchmarks/mnist.py``, real MNIST digits, batch
128, timings are medians over ``--repeats`` calls of jitted functions), and a sweep:

1. **What a check step costs when the trace rule refreshes all, some or none of the
   blocks.** THOR's claim is that skipped factor blocks cost neither a covariance nor an
   inversion. Under ``jax.jit`` that holds only if skipped work is not computed and then
   discarded; thor_optax refreshes on CPU only the blocks due, one at a time, and elsewhere
   gathers them into a buffer of a static budget and runs only that budget's branch
   (``blocks.masked_block_update``). After a first check, a second batch of
   statistics is built in which the input columns of a chosen fraction of every factor's blocks
   are scaled by 2: every other block's trace is unchanged (ratio 0, kept), and a chosen block's
   undamped trace is multiplied by 4. The rule compares *damped* traces, so a chosen block jumps
   past ``omega1 = 0.01`` only where its covariance is not drowned by its damping: on the MLP
   with every block chosen, 16 of 22 are refreshed, not the first hidden layer's 4 ``G`` blocks
   (cotangent trace about 0.05 next to the damping's 128 sqrt(0.03) = 22: the inverse is the
   damping's either way) nor the 2 ``A`` blocks that hold only a bias column (constant 1, not
   scaled).
   The table times the preconditioner's ``update`` on it (traces, trace rule, covariances and
   inversions of the blocks due, preconditioning) and counts the blocks actually refreshed (from
   the state's diagnostics).

2. **THOR's hardware-driven split** (Chen et al. 2021, "Hardware-driven matrix splitting"): for
   each candidate block size ``b``, the information loss of the block-diagonal approximation,
   ``L = 1 - sqrt(lambda_max(Ab Ab^T) / lambda_max(A A^T)) = 1 - lambda_max(Ab) / lambda_max(A)``
   for every factor (``A`` and ``G`` of every layer, each damped by ``sqrt(0.03)``: the equal
   split, not the ``thor`` alias's pi rule and floor), against the cost of a full THOR training
   step without statistics (plain) and with statistics refreshing every block (check), as
   multiples of an optax SGD-momentum step. The paper picks the size where the
   fraction of factors with ``L < 1%`` and the normalized speed cross (128 on Ascend for
   ResNet-50); this table is that measurement on the machine that runs it.

3. **Training steps and their compile times** (public API only): an optax SGD-momentum step, and
   THOR's plain step and check step (``thor_optax.thor``, block size ``--block-size``, a check
   that refreshes every block), each from the gradient and from the rows (``gradient_stats=``,
   on the check step along with ``curvature_stats=``), each the jitted step of
   ``benchmarks/mnist.py``; compile time is
   ``jit(...).lower(...).compile()`` of each step function, median ms of the steps after it.
   With ``--compare PATH`` (a checkout of another version of the package, e.g. a
   ``git worktree`` of an older commit) this table is measured for both versions in one run:
   ``--rounds`` rounds, each running one subprocess per version in alternating order, and the
   table gives the median over rounds of each figure and the ratio new / old.

4. **The plain step from the gradient or from its rows** (sample space, ``gradient_stats=``):
   an MLP 784-w-w-10 on real digits for a sweep of widths and batch sizes, THOR's plain step
   with the block products on the gradient matrix and with the factors applied to the rows
   where the rule picks them (``sample_space.sides``: ``A^-1`` on the rows when the batch is
   smaller than ``d_G``, ``G^-1`` when smaller than ``d_A``), as multiples of an SGD step;
   a reader sees where each form wins.

5. **What a plain step pays for** (``--tables parts``): the alias's plain step from the rows
   (``thor_optax.thor``, after one check) against the same step without the KL clip
   (``max_kl=None``), without the guard against non-finite steps (``skip_not_finite=False``),
   and without both and with heavy-ball momentum (the bare preconditioner and momentum SGD),
   each timed in interleaved rounds with an SGD step (``timing.interleaved_ms``), with XLA's
   FLOP count (``compile().cost_analysis()``) and the number of fused kernels of each compiled
   step. The difference between two rows is what the option costs.

Run::

    python3 benchmarks/check_step.py
    python3 benchmarks/check_step.py --tables parts --repeats 30
    python3 benchmarks/check_step.py --tasks mlp --block-size 64 --block-sizes 32 64 128 --repeats 50
    git worktree add /tmp/before <commit>
    python3 benchmarks/check_step.py --tables steps --compare /tmp/before --rounds 3
    python3 benchmarks/check_step.py --tables rows --widths 512 --batches 64 256
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mnist  # noqa: E402  (the benchmark's models, data and loss)
import options  # noqa: E402  (benchmarks/options.py, beside this script)
from timing import interleaved_ms, median_ms  # noqa: E402
import thor_optax  # noqa: E402
from thor_optax.flax import value_and_grad_with_stats  # noqa: E402

DAMPING = 0.03


def jump_blocks(stats: thor_optax.CurvatureStats, layout: Any,
                fraction: float) -> thor_optax.CurvatureStats:
  """Doubles the columns behind the first ``ceil(fraction * n)`` blocks of every factor.

  Input columns move only ``A``'s blocks, cotangent columns only ``G``'s. A conv input channel
  feeds ``k_h k_w`` consecutive patch columns (channel-major patches), so the channels scaled are
  those whose patch columns fall in the chosen blocks.
  """
  layers = dict(stats.layers)
  for spec in layout.layers:
    layer = layers[spec.name]

    def scale_first(x, slot, columns_per_channel):
      n = math.ceil(fraction * slot.num_blocks)
      channels = min(x.shape[-1], math.ceil(n * slot.block / columns_per_channel))
      return x.at[..., :channels].multiply(2.0) if n else x

    per_channel = 1 if spec.kind.name == "dense" else spec.kernel_shape[0] * spec.kernel_shape[1]
    fields = dict(vars(layer))
    fields["inputs"] = scale_first(layer.inputs, spec.a, per_channel)
    fields["cotangents"] = scale_first(layer.cotangents, spec.g, 1)
    layers[spec.name] = type(layer)(**fields)
  return thor_optax.CurvatureStats(layers=layers, unhandled=stats.unhandled)


def information_loss(stats: thor_optax.CurvatureStats, params, block_size: int) -> np.ndarray:
  """THOR's spectral information loss of every damped factor split with ``block_size``."""
  from thor_optax._src import blocks  # pylint: disable=import-outside-toplevel
  layout = blocks.build_layout(params, None)
  losses = []
  for spec in layout.layers:
    layer = stats.layers[spec.name]
    for rows, scale in (spec.kind.input_rows(spec, layer, jnp.float32),
                        spec.kind.cotangent_rows(spec, layer, jnp.float32)):
      full = np.asarray(scale * rows.T @ rows, np.float64)
      full += np.sqrt(DAMPING) * np.eye(len(full))
      mask = np.zeros_like(full)
      for start in range(0, len(full), block_size):
        mask[start:start + block_size, start:start + block_size] = 1.0
      top_full = np.linalg.eigvalsh(full)[-1]
      top_split = np.linalg.eigvalsh(full * mask)[-1]
      losses.append(1.0 - top_split / top_full)
  return np.asarray(losses)


class Setup:
  """One model, one batch of real digits, its gradients and statistics, and an SGD step."""

  def __init__(self, task: str, batch_size: int, repeats: int):
    train, _ = mnist.load_mnist(seed=0)
    self.model = mnist.MODELS[task]()
    self.x = jnp.asarray(train.x[:batch_size])
    self.y = jnp.asarray(train.y[:batch_size])
    self.params = self.model.init(jax.random.PRNGKey(0), self.x)["params"]
    self.capture = jax.jit(value_and_grad_with_stats(self.model, mnist.loss_fn))
    (_, self.grads), self.stats = self.capture(self.params, self.x, self.y)
    self.repeats = repeats
    sgd = optax.sgd(0.05, momentum=0.9)
    self.sgd_ms = self.time_training_step(sgd, with_stats=False)

  def time_training_step(self, tx, with_stats: bool, sample_space: bool = True) -> float:
    """ms of a full training step of ``benchmarks/mnist.py`` (check step or plain step; the
    plain step from the rows where cheaper with ``sample_space``, else from the gradient)."""
    check_step, plain_step = mnist.make_steps(self.model, tx, sample_space)
    step = check_step if with_stats else plain_step
    state = tx.init(self.params)
    variables = {"params": self.params}
    return median_ms(lambda: step(variables, state, self.x, self.y), self.repeats)

  def compile_and_run(self, tx, with_stats: bool,
                      sample_space: bool = True) -> tuple[float, float]:
    """``(compile seconds, median ms)`` of a training step of ``benchmarks/mnist.py``."""
    check_step, plain_step = mnist.make_steps(self.model, tx, sample_space)
    step = check_step if with_stats else plain_step
    args = ({"params": self.params}, tx.init(self.params), self.x, self.y)
    t0 = time.perf_counter()
    compiled = step.lower(*args).compile()
    seconds = time.perf_counter() - t0
    return seconds, median_ms(lambda: compiled(*args), self.repeats)


def steps_table(setup: Setup, block_size: int) -> dict[str, float]:
  """Table 3: SGD, THOR plain and THOR check steps (every block refreshed), ms and compile s."""
  out = {}
  thor = thor_optax.thor(0.05, DAMPING, block_size=block_size)
  every_block = thor_optax.thor(0.05, DAMPING, block_size=block_size, trace_thresholds=(0.0, 0.0))
  for name, tx, with_stats, sample_space in (
      ("sgd", optax.sgd(0.05, momentum=0.9), False, False),
      ("thor plain (gradient)", thor, False, False),
      ("thor plain (rows)", thor, False, True),
      ("thor check (gradient)", every_block, True, False),
      ("thor check (rows)", every_block, True, True)):
    out[f"{name} compile s"], out[f"{name} ms"] = setup.compile_and_run(tx, with_stats,
                                                                         sample_space)
  return out


PARTS = (("thor plain (rows)", {}),
         ("  without the KL clip", dict(max_kl=None)),
         ("  without the guard", dict(skip_not_finite=False)),
         ("  without both, heavy-ball", dict(max_kl=None, skip_not_finite=False,
                                             nesterov=False)))


def parts_table(setup: Setup, block_size: int) -> list[tuple[str, float, float, int]]:
  """Table 5: ``(step, ms, MFLOPs, fused kernels)`` of SGD and of THOR's plain step from the
  rows with and without its KL clip and guard (:data:`PARTS`), timed in interleaved rounds."""
  variables = {"params": setup.params}
  steps = {}
  for name, kwargs in (("sgd", None),) + PARTS:
    if kwargs is None:
      tx = optax.sgd(0.05, momentum=0.9)
      _, step = mnist.make_steps(setup.model, tx, sample_space=False)
      state = tx.init(setup.params)
    else:
      tx = thor_optax.thor(0.05, DAMPING, block_size=block_size, **kwargs)
      check, step = mnist.make_steps(setup.model, tx, sample_space=True)
      _, state, _ = check(variables, tx.init(setup.params), setup.x, setup.y)  # inverses
    args = (variables, state, setup.x, setup.y)
    steps[name] = (step.lower(*args).compile(), args)
  ms = interleaved_ms({name: (lambda c=c, a=a: c(*a)) for name, (c, a) in steps.items()},
                      setup.repeats)
  rows = []
  for name, (compiled, _) in steps.items():
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    rows.append((name, ms[name], cost.get("flops", float("nan")) / 1e6,
                 compiled.as_text().count(" fusion(")))
  return rows


def print_parts_table(setup: Setup, task: str, block_size: int) -> None:
  print(f"\n[{task}] 5. what THOR's plain step pays for (block size {block_size}; interleaved)")
  print(f"{'step':28s} {'ms':>8s} {'x SGD':>7s} {'MFLOPs':>8s} {'kernels':>8s}")
  rows = parts_table(setup, block_size)
  sgd_ms = rows[0][1]
  for name, ms, mflops, kernels in rows:
    print(f"{name:28s} {ms:8.3f} {ms / sgd_ms:7.2f} {mflops:8.0f} {kernels:8d}")


def compare(args) -> None:
  """Table 3 for this checkout and ``args.compare``, interleaved subprocesses, in one run."""
  here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  versions = {"new": here, "old": os.path.abspath(args.compare)}
  runs = {name: [] for name in versions}
  for r in range(args.rounds):
    for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
      env = dict(os.environ, PYTHONPATH=os.pathsep.join(
          [versions[name]] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
      if args.lapack_threads:
        # The same limit for both versions, as OpenBLAS's environment variable: an older
        # version of the package has no limit_lapack_threads.
        env["OPENBLAS_NUM_THREADS"] = str(args.lapack_threads)
      cmd = [sys.executable, os.path.abspath(__file__), "--tables", "steps", "--json",
             "--tasks", *args.tasks, "--block-size", str(args.block_size),
             "--batch-size", str(args.batch_size), "--repeats", str(args.repeats),
             "--lapack-threads", "0"]
      out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
      runs[name].append(json.loads(out.strip().splitlines()[-1]))
  print(f"training steps, new ({versions['new']}) vs old ({versions['old']}): median of "
        f"{args.rounds} rounds, alternating order")
  for task in args.tasks:
    print(f"\n[{task}] {'':22s} {'old':>10s} {'new':>10s} {'new / old':>10s}")
    for key in runs["new"][0][task]:
      old = float(np.median([run[task][key] for run in runs["old"]]))
      new = float(np.median([run[task][key] for run in runs["new"]]))
      print(f"{key:31s} {old:10.2f} {new:10.2f} {new / old:10.2f}")


def refresh_table(setup: Setup, block_size: int) -> list[tuple[str, float, str]]:
  """Rows ``(what, ms, blocks refreshed)`` of table 1."""
  from thor_optax._src import blocks  # pylint: disable=import-outside-toplevel
  params, grads = setup.params, setup.grads
  layout = blocks.build_layout(params, block_size)
  tx = thor_optax.scale_by_thor(DAMPING, block_size=block_size, trace_thresholds=(0.01, 0.0))
  check = jax.jit(lambda s, st: tx.update(grads, s, params, curvature_stats=st))
  plain = jax.jit(lambda s: tx.update(grads, s, params))
  _, state = check(tx.init(params), setup.stats)
  total = sum(spec.a.num_blocks + spec.g.num_blocks for spec in layout.layers)
  rows = [("optax SGD-momentum training step", setup.sgd_ms, ""),
          ("capture (loss, grads, statistics)",
           median_ms(lambda: setup.capture(params, setup.x, setup.y), setup.repeats), ""),
          ("update without statistics", median_ms(lambda: plain(state), setup.repeats), "")]
  for fraction in (0.0, 0.125, 0.25, 0.5, 1.0):
    jumped = jump_blocks(setup.stats, layout, fraction)
    _, after = check(state, jumped)
    refreshed = sum(int(d.blocks_refreshed) for d in after.diagnostics.values())
    ms = median_ms(lambda: check(state, jumped), setup.repeats)
    rows.append((f"update with statistics, {fraction:.3g} jumped", ms, f"{refreshed}/{total}"))
  return rows


def block_size_table(setup: Setup, sizes: list[int]) -> list[tuple]:
  """Rows ``(b, median L, share L < 1%, plain step / SGD, check step / SGD)`` of table 2."""
  rows = []
  for b in sizes:
    loss = information_loss(setup.stats, setup.params, b)
    tx = thor_optax.thor(0.05, DAMPING, block_size=b, trace_thresholds=(0.0, 0.0))
    plain = setup.time_training_step(tx, with_stats=False)
    check = setup.time_training_step(tx, with_stats=True)
    rows.append((b, float(np.median(loss)), float(np.mean(loss < 0.01)),
                 plain / setup.sgd_ms, check / setup.sgd_ms))
  return rows


class Wide(nn.Module):
  """784-w-w-10 perceptron with ReLU (table 4)."""

  width: int

  @nn.compact
  def __call__(self, x, train: bool = True):
    del train
    x = nn.relu(nn.Dense(self.width)(x))
    x = nn.relu(nn.Dense(self.width)(x))
    return nn.Dense(10)(x)


def sample_space_table(widths: list[int], batches: list[int], block_size: int,
                       repeats: int) -> list[tuple]:
  """Rows ``(width, batch, SGD ms, plain from the gradient / SGD, plain from the rows / SGD,
  sides)`` of table 4; ``sides``: per dense layer, which factors the rule applies to the rows
  (``A``, ``G``, both or ``-``)."""
  from thor_optax._src import blocks, sample_space  # pylint: disable=import-outside-toplevel
  train, _ = mnist.load_mnist(seed=0)
  rows = []
  for width in widths:
    model = Wide(width)
    for batch in batches:
      x, y = jnp.asarray(train.x[:batch]), jnp.asarray(train.y[:batch])
      params = model.init(jax.random.PRNGKey(0), x)["params"]
      variables = {"params": params}
      thor = thor_optax.thor(0.05, DAMPING, block_size=block_size)
      calls = {}
      for name, tx, rows_form in (("sgd", optax.sgd(0.05, momentum=0.9), False),
                                  ("gradient", thor, False), ("rows", thor, True)):
        _, plain = mnist.make_steps(model, tx, rows_form)
        state = tx.init(params)
        calls[name] = lambda p=plain, s=state: p(variables, s, x, y)
      ms = interleaved_ms(calls, max(1, repeats // 5))
      sides = []
      for spec in blocks.build_layout(params, block_size).layers:
        side = sample_space.sides(spec, batch)
        sides.append("AG" if all(side) else "A" if side.a else "G" if side.g else "-")
      rows.append((width, batch, ms["sgd"], ms["gradient"] / ms["sgd"], ms["rows"] / ms["sgd"],
                   " ".join(sides)))
  return rows


def print_sample_space_table(widths, batches, block_size, repeats) -> None:
  print(f"\n4. plain step from the gradient (block products on X) or from the rows (sample "
        f"space), 784-w-w-10, block size {block_size}, as multiples of an SGD step")
  print(f"{'width':>6s} {'batch':>6s} {'SGD ms':>8s} {'gradient':>9s} {'rows':>6s}   "
        "factors on the rows, per layer")
  for width, batch, sgd, grad, rows, sides in sample_space_table(widths, batches, block_size,
                                                                 repeats):
    print(f"{width:6d} {batch:6d} {sgd:8.2f} {grad:9.2f} {rows:6.2f}   {sides}")


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--tasks", nargs="+", default=["mlp", "cnn"], choices=("mlp", "cnn"))
  parser.add_argument("--block-size", type=int, default=128, help="block size of table 1")
  parser.add_argument("--block-sizes", type=int, nargs="+", default=[16, 32, 64, 128, 256],
                      help="candidates of table 2")
  parser.add_argument("--batch-size", type=int, default=128)
  parser.add_argument("--repeats", type=int, default=30)
  parser.add_argument("--tables", nargs="+", default=["refresh", "split", "steps", "rows"],
                      choices=("refresh", "split", "steps", "rows", "parts"))
  parser.add_argument("--widths", type=int, nargs="+", default=[256, 512, 1024],
                      help="hidden widths of table 4")
  parser.add_argument("--batches", type=int, nargs="+", default=[32, 128, 512, 2048],
                      help="batch sizes of table 4")
  parser.add_argument("--compare", default=None, metavar="PATH",
                      help="another checkout of the package: table 3 for both, in one run")
  parser.add_argument("--rounds", type=int, default=3, help="rounds of --compare")
  parser.add_argument("--json", action="store_true",
                      help="print table 3 as one JSON line (used by --compare)")
  options.add_lapack_threads_option(parser)
  args = parser.parse_args(argv)
  options.apply_lapack_threads(args)
  if args.compare:
    compare(args)
    return
  if args.json:
    print(json.dumps({task: steps_table(Setup(task, args.batch_size, args.repeats),
                                        args.block_size) for task in args.tasks}))
    return
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {os.cpu_count()} CPU cores")
  for task in args.tasks:
    setup = Setup(task, args.batch_size, args.repeats)
    if "steps" in args.tables:
      print(f"\n[{task}] 3. training steps (block size {args.block_size}): ms and compile s")
      for key, value in steps_table(setup, args.block_size).items():
        print(f"{key:24s} {value:10.2f}")
    if "refresh" in args.tables:
      print_refresh_table(setup, task, args.block_size, args.batch_size)
    if "split" in args.tables:
      print_split_table(setup, task, args.block_sizes)
    if "parts" in args.tables:
      print_parts_table(setup, task, args.block_size)
  if "rows" in args.tables:
    print_sample_space_table(args.widths, args.batches, args.block_size, args.repeats)


def print_refresh_table(setup: Setup, task: str, block_size: int, batch_size: int) -> None:
  print(f"\n[{task}] 1. cost of a check step by blocks refreshed "
        f"(block size {block_size}, batch {batch_size})")
  print(f"{'':44s} {'ms':>8s} {'x SGD step':>11s} {'blocks refreshed':>17s}")
  for what, ms, refreshed in refresh_table(setup, block_size):
    print(f"{what:44s} {ms:8.2f} {ms / setup.sgd_ms:11.2f} {refreshed:>17s}")


def print_split_table(setup: Setup, task: str, block_sizes: list[int]) -> None:
  print(f"\n[{task}] 2. hardware-driven split: information loss vs step cost "
        f"(SGD step {setup.sgd_ms:.2f} ms)")
  print(f"{'block':>6s} {'median L':>10s} {'L < 1%':>8s} {'plain step':>11s} "
        f"{'check step':>11s}   (steps as multiples of an SGD step)")
  for b, med, share, plain, check in block_size_table(setup, block_sizes):
    print(f"{b:6d} {med:10.4f} {share:8.0%} {plain:11.2f} {check:11.2f}")


if __name__ == "__main__":
  main()
