"""Which of THOR's approximations costs steps: K-FAC to THOR, one choice at a time.

THOR's paper differs from classic K-FAC (``thor_optax.kfac``: running-average factors, whole
factors, every block inverted at every check, a check at every step) in four choices:
current-batch factors, 128-blocks, the trace rule, and checks at a growing interval.
``thor_optax.thor`` keeps the last three, averages each block across its refreshes, takes
Nesterov momentum instead of heavy-ball, splits the damping by K-FAC's pi rule with ``pi``
clipped to ``[1/5, 5]`` and each block's damping floored at its mean eigenvalue, and bounds
its KL clip at 3e-2 (what this ablation found). ``kfac`` and THOR's paper split the damping
equally, ``sqrt(lambda)`` per factor. This script trains the MNIST models of
``benchmarks/mnist.py`` (same data, models, batches and evaluation) with:

* the *path* from ``kfac`` to THOR as in its paper (``+growing``) and on to ``thor``'s
  defaults (``+average``, ``+nesterov``, ``+pi``, then ``thor``), each row changing one choice
  of the one above (``+pi``: the damping split and its floor together);
* *leave-one-out* rows: ``thor`` with one choice set back to K-FAC's;
* SGD-momentum, Adam and Muon at their tuned rates, for the goals (THOR's steps at most
  kfac's and Muon's; its best accuracy within 0.2 points of the best first-order optimizer's).

Every second-order row runs at the tuned THOR / K-FAC learning rate and damping of the task
(``mnist.DEFAULT_LEARNING_RATE``: they are the same for both), with every other setting the
alias's default, so a row differs from the one it is compared with in one choice only. Each row
runs ``--seeds`` seeds; a seed ``s`` sets the initial parameters and the batch order
(``mnist.init_variables(..., s)``, ``mnist.batch_order(..., s)``); the train / test split is
fixed. The table prints, per row, the steps to each test-accuracy target for every seed (``-``:
not reached), the mean best and final test accuracy over the seeds (evaluated every
``--eval-every`` steps) and the mean training seconds (on a quiet machine; contention inflates
them, steps are unaffected).

Run (2 tasks x 21 rows x 3 seeds; about 45 minutes on a 2-core CPU shared with other jobs)::

  python3 benchmarks/ablation.py
  python3 benchmarks/ablation.py --tasks cnn --rows kfac thor --seeds 0 1 2 3 4
  python3 benchmarks/ablation.py --rows thor-pi --learning-rate 0.0646 --damping 0.1
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any, Callable, Optional

import numpy as np

import thor_optax

import mnist  # benchmarks/mnist.py, beside this script
import options

GROWING = (5, 50, 200)  # THOR's check schedule in mnist.py: growing_interval(5, 50, 200)


class Row:
  """One ablation row: an optimizer built from the task's tuned learning rate and damping.

  Attributes:
    name: the row's label.
    make: ``make(learning_rate, damping) -> optax transform`` (second-order), or ``None`` for a
      first-order optimizer of ``mnist.py`` (``name`` is then its name there).
    checks: check schedule (``mnist.DEFAULT_CHECKS`` format), ``None`` for first-order.
    what: the choice the row changes, for the table's legend.
  """

  def __init__(self, name: str, make: Optional[Callable], checks: Any, what: str):
    self.name, self.make, self.checks, self.what = name, make, checks, what


def _kfac(**kw):
  return lambda lr, damping: thor_optax.kfac(lr, damping, **kw)


def _thor(**kw):
  return lambda lr, damping: thor_optax.thor(lr, damping, **kw)


# thor's damping and KL clip before the pi default: sqrt(lambda) to each factor (THOR's
# paper), with the floor and the clip of the other aliases; the path rows up to +nesterov keep
# them.
EQUAL_SPLIT = dict(pi_damping=False, min_relative_damping=0.1, max_kl=1e-2)


ROWS = (
    # The path: kfac -> THOR as in its paper -> thor_optax.thor, one choice at a time.
    Row("kfac", _kfac(), 1, "thor_optax.kfac: running average (0.95), whole factors, every "
        "block at every check, a check every step"),
    Row("+current", _kfac(ema_decay=None), 1, "current-batch factors (ema_decay=None)"),
    Row("+blocks", _kfac(ema_decay=None, block_size=128), 1, "and 128-blocks"),
    Row("+trace", _thor(ema_decay=None, nesterov=False, **EQUAL_SPLIT), 1,
        "and THOR's trace rule (0.01, 0), checks every step"),
    Row("+growing", _thor(ema_decay=None, nesterov=False, **EQUAL_SPLIT), GROWING,
        "and the growing interval (5, 50, 200): THOR as in its paper (thor_optax.thor(..., "
        "ema_decay=None, nesterov=False, pi_damping=False, min_relative_damping=0.1, "
        "max_kl=1e-2))"),
    Row("+average", _thor(nesterov=False, **EQUAL_SPLIT), GROWING,
        "and a running average (0.95) across refreshes of each block formed from fewer than 4 "
        "rows per dimension"),
    Row("+nesterov", _thor(**EQUAL_SPLIT), GROWING,
        "and Nesterov momentum instead of heavy-ball (thor_optax.thor's defaults before the pi "
        "rule)"),
    Row("+pi", _thor(max_kl=1e-2), GROWING, "and the pi rule, pi clipped to [1/5, 5], with "
        "each block's damping at least its mean eigenvalue (min_relative_damping=1, not 0.1)"),
    Row("thor", _thor(), GROWING, "and the KL clip's bound 3e-2 instead of the other aliases' "
        "1e-2: thor_optax.thor's defaults, as in mnist.py"),
    # Leave one out: thor with one choice set back to K-FAC's.
    Row("thor-all", _thor(ema_rows_ratio=None), GROWING, "thor averaging every block, also "
        "those formed from many rows (K-FAC's running average)"),
    Row("thor-whole", _thor(block_size=None), GROWING, "thor with whole factors"),
    Row("thor-every", _thor(trace_thresholds=(0.0, 0.0)), GROWING,
        "thor refreshing every block at every check (trace_thresholds=(0, 0))"),
    Row("kfac-growing", _kfac(), GROWING, "kfac at THOR's growing interval"),
    Row("kfac-pi", _kfac(pi_damping=True), 1, "kfac with K-FAC's pi rule for the damping split"),
    Row("thor-pi", _thor(max_pi=None), GROWING, "thor with the pi rule unclipped"),
    Row("thor-pi3", _thor(max_pi=3.0), GROWING, "thor with pi clipped to [1/3, 3]"),
    Row("thor-floor", _thor(min_relative_damping=0.1), GROWING, "thor with the other aliases' "
        "damping floor, a tenth of each block's mean eigenvalue"),
    Row("thor-equal", _thor(pi_damping=False), GROWING, "thor with THOR's equal damping split "
        "(pi_damping=False)"),
    # First-order references at their tuned rates (mnist.DEFAULT_LEARNING_RATE).
    Row("sgd", None, None, "optax.sgd, momentum 0.9"),
    Row("adam", None, None, "optax.adam"),
    Row("muon", None, None, "optax.contrib.muon (Adam for the output layer and biases)"),
)
ROW_NAMES = tuple(row.name for row in ROWS)


def run_row(row: Row, task: str, seed: int, train_set: mnist.Split, test_set: mnist.Split,
            steps: int, batch_size: int, eval_every: int, learning_rate: Optional[float] = None,
            damping: Optional[float] = None) -> dict:
  """One row on one task and seed: steps to each target, best and final test accuracy.

  ``learning_rate`` / ``damping`` replace the task's tuned THOR values for a second-order row
  (``None``: ``mnist.DEFAULT_LEARNING_RATE`` / ``DEFAULT_DAMPING``)."""
  model = mnist.MODELS[task]()
  variables = mnist.init_variables(model, train_set.x[:1], seed)
  batches = mnist.batch_order(len(train_set.y), batch_size, steps, seed)
  rates = mnist.DEFAULT_LEARNING_RATE[task]
  if row.make is None:
    cfg = mnist.Config(row.name, rates[row.name], batch_size=batch_size,
                       adam_learning_rate=rates["adam"] if row.name == "muon" else None)
    optimizer = None
  else:
    lr = rates["thor"] if learning_rate is None else learning_rate
    damping = mnist.DEFAULT_DAMPING[task]["thor"] if damping is None else damping
    cfg = mnist.Config("thor", lr, damping, checks=row.checks, batch_size=batch_size)
    optimizer = (row.make(lr, damping), options.check_schedule(row.checks))
  start = time.perf_counter()
  history = mnist.train(model, variables, cfg, train_set, test_set, batches, eval_every,
                        desc=f"{task} {row.name} seed {seed}", optimizer=optimizer)
  targets = mnist.TARGETS[task]
  return {
      "task": task, "row": row.name, "seed": seed,
      "steps_to": {str(t): next((s for s, _, acc in history.curve if acc >= t), None)
                   for t in targets},
      "best_test_acc": max(acc for _, _, acc in history.curve),
      "final_test_acc": history.curve[-1][2],
      "train_seconds": float(np.sum(history.step_ms) / 1e3),
      "wall_seconds": time.perf_counter() - start,
  }


def print_table(task: str, records: list, rows: list, steps: int) -> None:
  """One task's table: per row, steps to each target per seed and mean accuracies."""
  targets = mnist.TARGETS[task]
  header = (["row"] + [f"steps>={t:g}" for t in targets]
            + ["best acc", "final acc", "train s"])
  lines = []
  for row in rows:
    mine = [r for r in records if r["row"] == row.name]
    if not mine:
      continue
    per_target = ["/".join("-" if r["steps_to"][str(t)] is None else str(r["steps_to"][str(t)])
                           for r in mine) for t in targets]
    lines.append([row.name] + per_target + [
        f"{np.mean([r['best_test_acc'] for r in mine]):.4f}",
        f"{np.mean([r['final_test_acc'] for r in mine]):.4f}",
        f"{np.mean([r['train_seconds'] for r in mine]):.1f}"])
  seeds = sorted({r["seed"] for r in records})
  print(f"\n== {task}: {steps} steps of batch 128, seeds {seeds} (steps per seed, "
        f"evaluated every {records[0].get('eval_every', '?')} steps) ==")
  print("\n".join(mnist.table_lines(header, lines, left=1)))
  for row in rows:
    print(f"  {row.name}: {row.what}")


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--tasks", nargs="+", choices=("mlp", "cnn"), default=["mlp", "cnn"])
  p.add_argument("--rows", nargs="+", choices=ROW_NAMES, default=list(ROW_NAMES))
  p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  p.add_argument("--steps", type=int, default=None,
                 help="training steps (default: mnist.py's per task: mlp 200, cnn 300)")
  p.add_argument("--eval-every", type=int, default=10, help="(default: %(default)s)")
  p.add_argument("--learning-rate", type=float, default=None,
                 help="the second-order rows' learning rate (default: the task's tuned THOR rate)")
  p.add_argument("--damping", type=float, default=None,
                 help="the second-order rows' damping (default: the task's tuned THOR damping)")
  p.add_argument("--out", default=None, help="write the records as JSON")
  options.add_lapack_threads_option(p)
  args = p.parse_args(argv)
  options.apply_lapack_threads(args)

  train_set, test_set = mnist.load_mnist()
  rows = [row for row in ROWS if row.name in args.rows]
  results = []
  for task in args.tasks:
    steps = args.steps or mnist.DEFAULT_STEPS[task]
    records = []
    for row in rows:
      for seed in args.seeds:
        record = run_row(row, task, seed, train_set, test_set, steps, 128, args.eval_every,
                         args.learning_rate, args.damping)
        record["eval_every"] = args.eval_every
        records.append(record)
    print_table(task, records, rows, steps)
    results.extend(records)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(results, f, indent=1)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
  main()
