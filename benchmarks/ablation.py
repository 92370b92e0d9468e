"""Which of THOR's approximations costs steps: K-FAC to THOR, one choice at a time.

THOR's paper differs from classic K-FAC (``thor_optax.kfac``: running-average factors, whole
factors, every block inverted at every check, a check at every step) in four choices:
current-batch factors, 128-blocks, the trace rule, and checks at a growing interval.
``thor_optax.thor`` keeps the last three, averages each block across its refreshes, takes
Nesterov momentum instead of heavy-ball, splits the damping by K-FAC's pi rule with ``pi``
clipped to ``[1/5, 5]`` and each block's damping floored at its mean eigenvalue, and bounds
its KL clip at 3e-2 (what this ablation found). ``kfac`` and THOR's paper split the damping
equally, ``sqrt(lambda)`` per factor. This script trains, with:

* the *path* from ``kfac`` to THOR as in its paper (``+growing``) and on to ``thor``'s
  defaults (``+average``, ``+nesterov``, ``+pi``, then ``thor``), each row changing one choice
  of the one above (``+pi``: the damping split and its floor together);
* *leave-one-out* rows: ``thor`` with one choice set back to K-FAC's;
* ``thor-eigh``: ``thor`` with eigendecompositions (exact damping of ``A (x) G``), and
  ``thor-root`` (MLP only): the same with the square-root preconditioner
  ``(A (x) G + lambda I)^-1/2`` (``inverse_power=0.5``) at 4 times the rate, which over 2,200
  steps (``--steps 2200``) reaches Adam's best test accuracy where ``thor`` stops 1.4 points
  below it;
* ``thor-sp`` (MLP only): ``thor`` with whole factors and SP-NGD's weight rescaling chained
  after it, at SP-NGD's tuned rate and damping: over seeds 0-5 it reached 92% in 55 steps
  (mean) with best accuracy 0.939, Adam's 0.940 (benchmarks/README.md, the ablation's goals item);
* *first steps* (MNIST, and ``thor-warm`` on the language model): ``thor-warm``, ``thor`` at
  a warm start of its rate (:func:`warm_start`: 3 times it at step 0, down to it by step 32),
  which makes up for the first steps of momentum SGD, a fifth of their steady size and
  growing over tens of steps, where Adam and Muon correct their momenta's bias;
  ``thor-debias-kl``, the bias correction itself folded into the rate
  (:func:`bias_corrected`) so that the KL clip bounds it;
  ``thor-debias-ratio``, ``debias_momentum=True`` with ``max_update_ratio=0.3``;
  ``thor-root-debias`` (MLP only), ``thor-root`` with the folded correction; and
  ``muon-warm`` (MLP only), Muon at the same warm start, so that the warm start's gain can
  be told from THOR's;
* the first-order optimizers of each benchmark at their tuned rates, for the goals (THOR's
  steps at most kfac's and Muon's; its best result within 0.2 points of the best first-order
  optimizer's): SGD-momentum, Adam and Muon on MNIST, AdamW and Muon on the language model,

the tasks

* ``mlp`` and ``cnn``: the MNIST models of ``benchmarks/mnist.py`` (same data, models, batches
  and evaluation; targets are test accuracies; 200 and 300 steps);
* ``lm``: the character-level transformer of ``benchmarks/lm.py`` with that script's defaults
  (2 scanned pre-LayerNorm blocks of width 128, attention preconditioned, 300 steps of 8 x 128
  characters, the warm-up + cosine learning-rate schedule of every optimizer there; targets are
  validation bits per character, lower is better).

Every second-order row runs at the tuned THOR learning rate and damping of the task
(``mnist.DEFAULT_LEARNING_RATE`` / ``lm.DEFAULT_LEARNING_RATE`` and ``DEFAULT_DAMPING``; on
MNIST K-FAC's tuned values are the same), with every other setting the alias's default, so a
row differs from the one it is compared with in one choice only. A *growing* row checks at the
task's THOR schedule: ``growing_interval(5, 50, 200)`` on MNIST (``mnist.DEFAULT_CHECKS``),
``growing_interval(2, 20, 200)`` on the language model (``lm.DEFAULT_CHECKS``). Each row runs
``--seeds`` seeds; a seed ``s`` sets the initial parameters and the batch order
(``mnist.init_variables(..., s)`` and ``mnist.batch_order(..., s)``; ``model.init(PRNGKey(s))``
and ``lm.batch_offsets(..., s)``); the train / test split and the validation text are fixed.
The table prints, per row, the steps to each target for every seed (``-``: not reached) and
their mean over the seeds that reached it, the mean best and final result over the seeds
(evaluated every ``--eval-every`` steps), the median check step (ms) and the mean training
seconds (on a quiet machine; contention inflates them, steps are unaffected). A second table
compares one row (``--compare``, default ``thor``) with each other row seed by seed: the mean
difference in steps to each target with its standard error over the seeds where both reached
it, and the mean difference in best result. Three seeds rarely settle a comparison (on the CNN,
seeds 0-5 put Muon ahead of ``thor`` to 95% and seeds 6-11 put it behind), so runs save their
records (``--out``) and ``--records`` prints the tables of several runs' records together.
A target counts as reached at the first evaluation that reaches it; ``--hold K`` counts it
where it then stays reached for ``K`` evaluations in a row (an accuracy that touches 92% and
falls back is not credited with it), from the evaluations the records keep.

Run (MNIST: 31 rows on the MLP and 27 on the CNN x 3 seeds, over an hour on a 2-core CPU
shared with other jobs; the language model: 20 s to 2 minutes a row and seed, the rows checking
at every step the slowest; 12 rows x 3 seeds took 36 minutes beside the test suite)::

  python3 benchmarks/ablation.py
  python3 benchmarks/ablation.py --tasks cnn --rows kfac thor --seeds 0 1 2 3 4
  python3 benchmarks/ablation.py --rows thor-pi --learning-rate 0.0646 --damping 0.1
  python3 benchmarks/ablation.py --tasks lm --seeds 0 --rows kfac +current +blocks +trace \
      +growing +average +nesterov +pi thor adamw muon
  python3 benchmarks/ablation.py --tasks mlp cnn --rows kfac thor sgd adam muon \
      --seeds 0 1 2 3 4 5 6 7 8 9 10 11 --eval-every 5 --out mnist12.json
  python3 benchmarks/ablation.py --records mnist12.json more_seeds.json --compare thor
  python3 benchmarks/ablation.py --records hold12.json --hold 3
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from typing import Any, Callable, Optional

import jax
import numpy as np
import optax

import thor_optax

import lm  # benchmarks/lm.py, beside this script
import mnist  # benchmarks/mnist.py, beside this script
import options

MNIST_TASKS = ("mlp", "cnn")
TASKS = MNIST_TASKS + ("lm",)

# A row's `checks` for THOR's growing interval: the task's own schedule (GROWING_INTERVAL).
GROWING = "growing"
GROWING_INTERVAL = {"mlp": mnist.DEFAULT_CHECKS["thor"], "cnn": mnist.DEFAULT_CHECKS["thor"],
                    "lm": lm.DEFAULT_CHECKS["thor"]}


class Row:
  """One ablation row: an optimizer built from the task's tuned learning rate and damping.

  Attributes:
    name: the row's label.
    make: ``make(learning_rate, damping, **extra) -> optax transform`` (second-order; ``extra``
      is ``precondition_mask`` on the language model), ``make(rates) -> optax transform`` for
      a first-order row built here (``rates``: ``mnist.DEFAULT_LEARNING_RATE`` of the task;
      MNIST only), or ``None`` for a first-order optimizer of ``mnist.py`` / ``lm.py``
      (``name`` is then its name there).
    checks: check schedule (``mnist.DEFAULT_CHECKS`` format, or :data:`GROWING` for the task's
      growing interval), ``None`` for first-order.
    what: the choice the row changes, for the table's legend.
    tasks: the tasks the row runs on (``None``: every task).
  """

  def __init__(self, name: str, make: Optional[Callable], checks: Any, what: str,
               tasks: Optional[tuple] = None):
    self.name, self.make, self.checks, self.what = name, make, checks, what
    self.tasks = TASKS if tasks is None else tasks


def _kfac(**kw):
  return lambda lr, damping, **extra: thor_optax.kfac(lr, damping, **kw, **extra)


def _thor(**kw):
  return lambda lr, damping, **extra: thor_optax.thor(lr, damping, **kw, **extra)


def _thor_sp(task: str):
  """thor with whole factors and SP-NGD's weight rescaling chained after it, at SP-NGD's tuned
  rate and damping of ``task`` in ``mnist.py`` (the row's own, not the task's THOR values)."""
  rate = mnist.DEFAULT_LEARNING_RATE[task]["spngd"]
  damping = mnist.DEFAULT_DAMPING[task]["spngd"]
  return lambda lr, d, **extra: optax.chain(
      thor_optax.thor(rate, damping, block_size=None, **extra), thor_optax.rescale_weight_norms())


def _thor_root(rate_factor: float):
  """thor with eigendecompositions and the square-root preconditioner
  ``(A (x) G + lambda I)^-1/2`` at ``rate_factor`` times the row's learning rate (the damped
  eigenvalues are mostly below 1 at ``lambda = 0.03``, where ``e^-1/2 < e^-1``: the square root
  shortens the steps, least along the largest curvature, so at the MLP's tuned rate it trained
  slower; 4x was the best of 1, 2, 4, 8 and 16 on seed 0 over 2,200 steps). On the CNN it
  costs steps at any of the rates tried (seeds 0-2, evaluated every 5 steps: 95% in 68 steps at
  THOR's own rate against ``thor``'s 42, in 84 over 12 seeds at 4 times it; benchmarks/README.md,
  "Long training"), with the momentum's bias correction too ("First steps")."""
  return lambda lr, damping, **extra: thor_optax.thor(
      rate_factor * lr, damping, inverse_method="eigh", inverse_power=0.5, **extra)


def warm_start(rate: Any) -> optax.Schedule:
  """The rate ``rate * max(3 * 2^(-t / 20), 1)`` at step ``t``: 3 times ``rate`` at step 0,
  halving every 20 steps down to ``rate`` from step 32 on (``rate`` times an
  ``optax.exponential_decay`` factor).
  ``rate`` is a float or a schedule (the language model's warm-up and cosine decay), which
  the factor then multiplies.

  An ``optax.sgd`` trace starts at ``1 - momentum^2`` of its steady size (Nesterov, momentum
  0.9: 0.19) and needs tens of steps to grow, where Adam's and Muon's bias-corrected momenta
  step at full size from the first update; the warm start makes up for it over about as many
  steps."""
  factor = optax.exponential_decay(3.0, 20, 0.5, end_value=1.0)
  return lambda step: (rate(step) if callable(rate) else rate) * factor(step)


def bias_corrected(rate: float, momentum: float = 0.9) -> optax.Schedule:
  """The rate ``rate / (1 - momentum^(t + 2))`` at step ``t``: Nesterov momentum's bias
  correction (``thor(..., debias_momentum=True)``) folded into the rate, so that the KL clip,
  which reads the rate, bounds the corrected step."""
  return lambda step: rate / (1.0 - momentum ** (step + 2))


def _thor_scheduled(schedule: Callable[[Any], optax.Schedule], **kw):
  """thor at ``schedule(rate)`` (:func:`warm_start`, :func:`bias_corrected`) for the row's rate."""
  return lambda lr, damping, **extra: thor_optax.thor(schedule(lr), damping, **kw, **extra)


def _muon_warm(rates: dict) -> optax.GradientTransformation:
  """``mnist.py``'s Muon with :func:`warm_start` on its rate and on its Adam part's."""
  return optax.contrib.muon(warm_start(rates["muon"]),
                            adam_learning_rate=warm_start(rates["adam"]),
                            muon_weight_dimension_numbers=mnist.muon_dimension_numbers)


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
        "and the growing interval (MNIST (5, 50, 200), LM (2, 20, 200)): THOR as in its paper "
        "(thor_optax.thor(..., ema_decay=None, nesterov=False, pi_damping=False, "
        "min_relative_damping=0.1, max_kl=1e-2))"),
    Row("+average", _thor(nesterov=False, **EQUAL_SPLIT), GROWING,
        "and a running average (0.95) across refreshes of each block formed from fewer than 4 "
        "rows per dimension"),
    Row("+nesterov", _thor(**EQUAL_SPLIT), GROWING,
        "and Nesterov momentum instead of heavy-ball (thor_optax.thor's defaults before the pi "
        "rule)"),
    Row("+pi", _thor(max_kl=1e-2), GROWING, "and the pi rule, pi clipped to [1/5, 5], with "
        "each block's damping at least its mean eigenvalue (min_relative_damping=1, not 0.1)"),
    Row("thor", _thor(), GROWING, "and the KL clip's bound 3e-2 instead of the other aliases' "
        "1e-2: thor_optax.thor's defaults, as in mnist.py and lm.py"),
    # Leave one out: thor with one choice set back to K-FAC's.
    Row("thor-all", _thor(ema_rows_ratio=None), GROWING, "thor averaging every block, also "
        "those formed from many rows (K-FAC's running average)"),
    Row("thor-whole", _thor(block_size=None), GROWING, "thor with whole factors"),
    Row("thor-every", _thor(trace_thresholds=(0.0, 0.0)), GROWING,
        "thor refreshing every block at every check (trace_thresholds=(0, 0))"),
    Row("thor-stale1", _thor(max_stale_checks=1), GROWING, "thor refreshing every block "
        "skipped at the check before, whatever its trace (max_stale_checks=1)"),
    Row("kfac-growing", _kfac(), GROWING, "kfac at THOR's growing interval"),
    Row("kfac-pi", _kfac(pi_damping=True), 1, "kfac with K-FAC's pi rule for the damping split"),
    Row("thor-pi", _thor(max_pi=None), GROWING, "thor with the pi rule unclipped"),
    Row("thor-pi3", _thor(max_pi=3.0), GROWING, "thor with pi clipped to [1/3, 3]"),
    Row("thor-floor", _thor(min_relative_damping=0.1), GROWING, "thor with the other aliases' "
        "damping floor, a tenth of each block's mean eigenvalue"),
    Row("thor-equal", _thor(pi_damping=False), GROWING, "thor with THOR's equal damping split "
        "(pi_damping=False)"),
    Row("thor-debias", _thor(debias_momentum=True), GROWING, "thor with its momentum's bias "
        "correction (debias_momentum=True: full-size first steps)"),
    Row("thor-eigh", _thor(inverse_method="eigh"), GROWING, "thor with eigendecompositions: "
        "exact damping of A (x) G (no pi split)", MNIST_TASKS),
    Row("thor-root", _thor_root(4.0), GROWING, "thor-eigh preconditioning with the square root "
        "(A (x) G + lambda I)^-1/2 (inverse_power=0.5) at 4 times the rate (MLP only: on the "
        "CNN it costs steps)", ("mlp",)),
    Row("thor-warm", _thor_scheduled(warm_start), GROWING, "thor with a warm start of the rate: "
        "3 times it at step 0, halving every 20 steps down to it (warm_start; the KL clip "
        "reads it; lm: on its warm-up and cosine schedule)"),
    Row("thor-debias-kl", _thor_scheduled(bias_corrected), GROWING, "thor with the momentum's bias "
        "correction folded into the rate (bias_corrected), so that the KL clip bounds the "
        "corrected step", MNIST_TASKS),
    Row("thor-debias-ratio", _thor(debias_momentum=True, max_update_ratio=0.3), GROWING,
        "thor-debias with each kernel's step at most 0.3 times its norm (max_update_ratio)",
        MNIST_TASKS),
    Row("thor-root-debias", _thor_scheduled(lambda lr: bias_corrected(4.0 * lr),
                                            inverse_method="eigh", inverse_power=0.5), GROWING,
        "thor-root with the bias correction folded into the rate, as thor-debias-kl (MLP only)",
        ("mlp",)),
    Row("thor-sp", _thor_sp("mlp"), GROWING, "thor with whole factors and SP-NGD's weight "
        "rescaling (thor_optax.rescale_weight_norms chained after it) at SP-NGD's tuned rate "
        "and damping (0.03, 0.01; --learning-rate / --damping do not apply)", ("mlp",)),
    # First-order references at their tuned rates (mnist / lm DEFAULT_LEARNING_RATE).
    Row("sgd", None, None, "optax.sgd, momentum 0.9 (lm: lm.py's schedule)"),
    Row("adam", None, None, "optax.adam", MNIST_TASKS),
    Row("adamw", None, None, "optax.adamw (weight decay 1e-4), lm.py's schedule", ("lm",)),
    Row("muon", None, None, "optax.contrib.muon (Adam for the output layer, embeddings, biases "
        "and norms)"),
    Row("muon-warm", _muon_warm, None, "muon with warm_start on its rate and its Adam part's, "
        "the shape thor-warm gives THOR", ("mlp",)),
)
ROW_NAMES = tuple(row.name for row in ROWS)


def steps_of(task: str) -> int:
  """The task's training steps: ``mnist.DEFAULT_STEPS`` (mlp 200, cnn 300), ``lm.DEFAULT_STEPS``."""
  return lm.DEFAULT_STEPS if task == "lm" else mnist.DEFAULT_STEPS[task]


def eval_every_of(task: str) -> int:
  """Steps between evaluations: 10 on MNIST, ``lm.py``'s 20 on the language model."""
  return 20 if task == "lm" else 10


def targets_of(task: str) -> tuple[tuple, bool]:
  """The task's targets and whether lower is better (the LM's bits per character)."""
  return (lm.DEFAULT_TARGETS, True) if task == "lm" else (mnist.TARGETS[task], False)


def checks_of(row: Row, task: str) -> Any:
  """The row's check schedule on ``task`` (``mnist.DEFAULT_CHECKS`` format)."""
  return GROWING_INTERVAL[task] if row.checks == GROWING else row.checks


def steps_to_target(curve: list, target: float, lower: bool, hold: int = 1) -> Optional[int]:
  """The step of the first evaluation at which ``target`` is reached and stays reached for
  ``hold`` evaluations in a row (that one and the ``hold - 1`` after it), or ``None``.

  Args:
    curve: ``[(step, value), ...]`` in the order evaluated.
    target: the value to reach: at most it when ``lower``, at least it otherwise.
    lower: whether lower values are better (bits per character).
    hold: evaluations in a row (>= 1; 1 counts the first evaluation that reaches it, which an
      optimizer whose accuracy touches the target and falls back gets credited with).
  """
  reached = [v <= target if lower else v >= target for _, v in curve]
  return next((curve[i][0] for i in range(len(curve) - hold + 1) if all(reached[i:i + hold])),
              None)


def _record(row: Row, task: str, seed: int, history: Any, start: float) -> dict:
  """The JSON-ready record of one run: steps to each target, best and final result, times,
  and the evaluations (``curve``: ``[step, value]`` pairs) for :func:`held_records`."""
  targets, lower = targets_of(task)
  curve = [[s, v] for s, _, v in history.curve]
  values = [v for _, v in curve]
  check_ms = [ms for ms, c in zip(history.step_ms, history.is_check) if c]
  return {
      "task": task, "row": row.name, "seed": seed,
      "metric": "validation bits per character" if lower else "test accuracy",
      "steps_to": {str(t): steps_to_target(curve, t, lower) for t in targets},
      "curve": curve,
      "best": min(values) if lower else max(values),
      "final": values[-1],
      "num_checks": len(check_ms),
      "check_ms": float(np.median(check_ms)) if check_ms else None,
      "train_seconds": float(np.sum(history.step_ms) / 1e3),
      "wall_seconds": time.perf_counter() - start,
  }


def run_row(row: Row, task: str, seed: int, data: Any, steps: Optional[int] = None,
            eval_every: Optional[int] = None, learning_rate: Optional[float] = None,
            damping: Optional[float] = None) -> dict:
  """One row on one task and seed: steps to each target, best and final result.

  Args:
    row: the row.
    task: ``'mlp'``, ``'cnn'`` or ``'lm'``.
    seed: seed of the initial parameters and of the batch order.
    data: :func:`load_data` of the task.
    steps: training steps (``None``: :func:`steps_of`).
    eval_every: steps between evaluations (``None``: :func:`eval_every_of`).
    learning_rate, damping: replace the task's tuned THOR values for a second-order row
      (``None``: ``DEFAULT_LEARNING_RATE`` / ``DEFAULT_DAMPING`` of ``mnist.py`` or ``lm.py``).

  Returns:
    the record of :func:`_record`.

  Raises:
    ValueError: the row does not run on ``task`` (a first-order optimizer of another script).
  """
  if task not in row.tasks:
    raise ValueError(f"benchmarks/ablation.py: row {row.name!r} runs on {row.tasks}, not on "
                     f"{task!r}; pick rows of this task with --rows")
  run = _run_lm if task == "lm" else _run_mnist
  return run(row, task, seed, data, steps or steps_of(task), eval_every or eval_every_of(task),
             learning_rate, damping)


def _run_mnist(row, task, seed, data, steps, eval_every, learning_rate, damping) -> dict:
  """:func:`run_row` on an MNIST model (``data``: ``(train, test)`` splits)."""
  train_set, test_set = data
  model = mnist.MODELS[task]()
  variables = mnist.init_variables(model, train_set.x[:1], seed)
  batches = mnist.batch_order(len(train_set.y), 128, steps, seed)
  rates = mnist.DEFAULT_LEARNING_RATE[task]
  if row.make is None:
    cfg = mnist.Config(row.name, rates[row.name],
                       adam_learning_rate=rates["adam"] if row.name == "muon" else None)
    optimizer = None
  elif row.checks is None:  # a first-order optimizer built by the row from the tuned rates
    cfg = mnist.Config(row.name, rates[row.name.split("-")[0]])
    optimizer = (row.make(rates), None)
  else:
    lr = rates["thor"] if learning_rate is None else learning_rate
    damping = mnist.DEFAULT_DAMPING[task]["thor"] if damping is None else damping
    checks = checks_of(row, task)
    cfg = mnist.Config("thor", lr, damping, checks=checks)
    optimizer = (row.make(lr, damping), options.check_schedule(checks))
  start = time.perf_counter()
  history = mnist.train(model, variables, cfg, train_set, test_set, batches, eval_every,
                        desc=f"{task} {row.name} seed {seed}", optimizer=optimizer)
  return _record(row, task, seed, history, start)


def _run_lm(row, task, seed, data, steps, eval_every, learning_rate, damping) -> dict:
  """:func:`run_row` on the language model (``data``: :func:`load_data`'s tuple)."""
  args, corpus, model, val = data
  x0, _ = lm.windows(corpus.train, np.zeros(1, np.int64), args.context)
  params = jax.jit(model.init)(jax.random.PRNGKey(seed), x0)["params"]
  offsets = lm.batch_offsets(len(corpus.train), args.context, args.batch_size, steps, seed)
  if row.make is None:
    cfg, optimizer = lm.base_config(args, row.name), None
  else:
    lr = lm.DEFAULT_LEARNING_RATE["thor"] if learning_rate is None else learning_rate
    damping = lm.DEFAULT_DAMPING["thor"] if damping is None else damping
    checks = checks_of(row, task)
    cfg = lm.Config("thor", lr, damping, checks=checks)

    def optimizer(precondition_mask):
      tx = row.make(lm.lr_schedule(lr, steps), damping, precondition_mask=precondition_mask)
      return tx, options.check_schedule(checks)
  start = time.perf_counter()
  history = lm.train(model, params, cfg, corpus, offsets, val, args.context, eval_every,
                     desc=f"lm {row.name} seed {seed}", optimizer=optimizer)
  return _record(row, task, seed, history, start)


@functools.lru_cache(maxsize=None)
def load_data(task: str) -> Any:
  """The task's data: MNIST ``(train, test)``, or the language model's ``(lm.py's default
  arguments, corpus, model, validation windows)``."""
  if task in MNIST_TASKS:
    return mnist.load_mnist()
  args = lm.parse_args([])
  corpus = lm.load_corpus()
  model = lm.CharTransformer(vocab_size=len(corpus.vocab), width=args.width,
                             num_heads=args.heads, num_layers=args.layers, context=args.context)
  return args, corpus, model, lm.validation_windows(corpus.val, args.context, args.val_windows)


def _steps_cell(values: list) -> str:
  """Steps to a target per seed (``-``: not reached), then their mean over the seeds that
  reached it and, when some did not, how many did: ``40/-/50 = 45.0 (2/3)``."""
  cell = "/".join("-" if v is None else str(v) for v in values)
  reached = [v for v in values if v is not None]
  if len(values) > 1 and reached:
    cell += f" = {np.mean(reached):.1f}"
    if len(reached) < len(values):
      cell += f" ({len(reached)}/{len(values)})"
  return cell


def mean_and_error(values: list, digits: int) -> str:
  """``mean +- standard error`` of ``values`` with ``digits`` decimals (the error from the
  sample standard deviation, ``std / sqrt(n)``; the mean alone for one value, ``-`` for
  none)."""
  if not values:
    return "-"
  if len(values) == 1:
    return f"{values[0]:+.{digits}f}"
  error = np.std(values, ddof=1) / np.sqrt(len(values))
  return f"{np.mean(values):+.{digits}f} +- {error:.{digits}f}"


def paired_rows(task: str, records: list, compare: str) -> tuple[list, list]:
  """The paired comparison of row ``compare`` with every other row on the seeds both ran.

  Per target: the mean difference in steps (``compare`` minus the other row; negative:
  ``compare`` is faster) with its standard error over the seeds where both reached the target,
  then ``both/only compare/only other`` seed counts; and the mean difference in best result.
  Differences within about two standard errors of zero are level on these seeds.

  Returns:
    ``(header, lines)`` for ``mnist.table_lines`` (no lines if ``compare`` did not run).
  """
  targets, lower = targets_of(task)
  by_row: dict[str, dict[int, dict]] = {}
  for r in records:
    by_row.setdefault(r["row"], {})[r["seed"]] = r
  header = (["against", "seeds"] + [f"d steps{'<=' if lower else '>='}{t:g}" for t in targets]
            + [f"d best {'bpc' if lower else 'acc'}"])
  mine = by_row.get(compare, {})
  lines = []
  for name, theirs in by_row.items():
    seeds = sorted(set(mine) & set(theirs))
    if name == compare or not seeds:
      continue
    cells = [name, str(len(seeds))]
    for t in targets:
      ours = [mine[s]["steps_to"][str(t)] for s in seeds]
      other = [theirs[s]["steps_to"][str(t)] for s in seeds]
      both = [a - b for a, b in zip(ours, other) if a is not None and b is not None]
      only_ours = sum(a is not None and b is None for a, b in zip(ours, other))
      only_theirs = sum(a is None and b is not None for a, b in zip(ours, other))
      cells.append(f"{mean_and_error(both, 1)} ({len(both)}/{only_ours}/{only_theirs})")
    cells.append(mean_and_error([mine[s]["best"] - theirs[s]["best"] for s in seeds], 4))
    lines.append(cells)
  return header, lines


def print_table(task: str, records: list, rows: list, steps: int,
                compare: Optional[str] = "thor", hold: int = 1) -> None:
  """One task's table: per row, steps to each target per seed and mean results; then the
  paired comparison of row ``compare`` with the others (:func:`paired_rows`). ``hold``: the
  evaluations in a row the records' ``steps_to`` were counted at (:func:`held_records`), for
  the title."""
  targets, lower = targets_of(task)
  kind = "bpc" if lower else "acc"
  header = (["row"] + [f"steps{'<=' if lower else '>='}{t:g}" for t in targets]
            + [f"best {kind}", f"final {kind}", "check ms", "train s"])
  lines = []
  shown = []
  for row in rows:
    mine = sorted((r for r in records if r["row"] == row.name), key=lambda r: r["seed"])
    if not mine:
      continue
    shown.append(row)
    per_target = [_steps_cell([r["steps_to"][str(t)] for r in mine]) for t in targets]
    check_ms = [r["check_ms"] for r in mine if r["check_ms"] is not None]
    lines.append([row.name] + per_target + [
        f"{np.mean([r['best'] for r in mine]):.4f}",
        f"{np.mean([r['final'] for r in mine]):.4f}",
        f"{np.mean(check_ms):.1f}" if check_ms else "-",
        f"{np.mean([r['train_seconds'] for r in mine]):.1f}"])
  seeds = sorted({r["seed"] for r in records})
  batch = "8 x 128 characters" if lower else "128 digits"
  held = f", held for {hold} evaluations in a row" if hold > 1 else ""
  print(f"\n== {task}: {steps} steps of {batch}, seeds {seeds} (steps per seed = mean over the "
        f"seeds that reached the target{held}; evaluated every "
        f"{records[0].get('eval_every', '?')} steps; {records[0]['metric']}) ==")
  print("\n".join(mnist.table_lines(header, lines, left=1)))
  for row in shown:
    print(f"  {row.name}: {row.what}")
  if compare is not None:
    header, lines = paired_rows(task, records, compare)
    if lines:
      print(f"\n{task}: {compare} against each row on the seeds both ran (mean difference "
            f"+- standard error over the seeds where both reached the target; (both/only "
            f"{compare}/only the other) seed counts; best: {compare}'s minus the other's)")
      print("\n".join(mnist.table_lines(header, lines, left=1)))


def held_records(records: list, hold: int) -> list:
  """``records`` with each ``steps_to`` counted from its ``curve`` by :func:`steps_to_target`
  at ``hold`` evaluations in a row (``hold=1``: the records unchanged).

  Raises:
    ValueError: ``hold < 1``, or ``hold > 1`` and a record has no ``curve`` (records written
      before it was saved; the message names the row and seed).
  """
  if hold < 1:
    raise ValueError(f"benchmarks/ablation.py: --hold must be at least 1, got {hold}")
  if hold == 1:
    return records
  out = []
  for r in records:
    if "curve" not in r:
      raise ValueError(f"benchmarks/ablation.py: the record of {r['task']} {r['row']} seed "
                       f"{r['seed']} has no curve to count --hold {hold} from; rerun the row "
                       "with this version (or leave --hold at 1)")
    lower = targets_of(r["task"])[1]
    out.append({**r, "steps_to": {t: steps_to_target(r["curve"], float(t), lower, hold)
                                  for t in r["steps_to"]}})
  return out


def load_records(paths: list) -> list:
  """Records saved by ``--out``, merged: a later file's record of the same task, row and seed
  replaces an earlier one.

  Raises:
    ValueError: a file does not hold a list of this script's records (the message names it).
  """
  merged: dict[tuple, dict] = {}
  for path in paths:
    with open(path) as f:
      records = json.load(f)
    if not isinstance(records, list) or not all(
        isinstance(r, dict) and {"task", "row", "seed", "steps_to", "best"} <= set(r)
        for r in records):
      raise ValueError(f"benchmarks/ablation.py: {path} does not hold the records that "
                       "--out writes (a JSON list of runs with task, row, seed, steps_to, "
                       "best); pass files written by this script")
    for r in records:
      merged[(r["task"], r["row"], r["seed"])] = r
  return list(merged.values())


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--tasks", nargs="+", choices=TASKS, default=None,
                 help="(default: mlp cnn, or every task with --records; lm: the language "
                 "model of lm.py)")
  p.add_argument("--rows", nargs="+", choices=ROW_NAMES, default=list(ROW_NAMES),
                 help="(default: every row of each task)")
  p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  p.add_argument("--steps", type=int, default=None,
                 help="training steps (default: the task's: mlp 200, cnn 300, lm 300)")
  p.add_argument("--eval-every", type=int, default=None,
                 help="steps between evaluations (default: MNIST 10, lm 20)")
  p.add_argument("--learning-rate", type=float, default=None,
                 help="the second-order rows' learning rate (default: the task's tuned THOR rate)")
  p.add_argument("--damping", type=float, default=None,
                 help="the second-order rows' damping (default: the task's tuned THOR damping)")
  p.add_argument("--out", default=None,
                 help="write the records as JSON, as measured: their steps_to count the first "
                 "evaluation that reaches each target whatever --hold says (the curves are "
                 "saved: --records FILE --hold K recounts)")
  p.add_argument("--records", nargs="+", default=None, metavar="FILE",
                 help="print the tables of records saved by --out (merged; several runs' "
                 "seeds together) instead of training; --tasks and --rows still select")
  p.add_argument("--hold", type=int, default=1,
                 help="count a target as reached at the first evaluation from which it holds "
                 "for this many evaluations in a row (default: %(default)s, the first "
                 "evaluation that reaches it)")
  p.add_argument("--compare", default="thor",
                 help="the row compared with every other row, seed by seed (default: "
                 "%(default)s; 'none' for no comparison)")
  options.add_lapack_threads_option(p)
  args = p.parse_args(argv)
  if args.hold < 1:
    p.error(f"--hold must be at least 1, got {args.hold}")
  options.apply_lapack_threads(args)
  compare = None if args.compare == "none" else args.compare
  if args.tasks is None:
    args.tasks = list(TASKS if args.records else MNIST_TASKS)

  if args.records:
    results = held_records([r for r in load_records(args.records)
                            if r["task"] in args.tasks and r["row"] in args.rows], args.hold)
    for task in args.tasks:
      records = [r for r in results if r["task"] == task]
      if records:
        steps = records[0].get("steps", steps_of(task))
        settings = sorted({(r.get("steps"), r.get("eval_every")) for r in records}, key=str)
        if len(settings) > 1:
          print(f"\nnote: the {task} records mix (steps, eval_every) settings {settings}; "
                "steps to a target are counted at each run's own evaluations")
        print_table(task, records, [row for row in ROWS if task in row.tasks], steps, compare,
                    args.hold)
  else:
    results = []
    for task in args.tasks:
      rows = [row for row in ROWS if row.name in args.rows and task in row.tasks]
      steps = args.steps or steps_of(task)
      eval_every = args.eval_every or eval_every_of(task)
      records = []
      for row in rows:
        for seed in args.seeds:
          record = run_row(row, task, seed, load_data(task), steps, eval_every,
                           args.learning_rate, args.damping)
          record.update(eval_every=eval_every, steps=steps)
          records.append(record)
      if records:
        print_table(task, held_records(records, args.hold), rows, steps, compare, args.hold)
      results.extend(records)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(results, f, indent=1)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
  main()
