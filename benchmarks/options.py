"""Command-line options, check schedules and ``--tune``'s grid searches shared by the benchmarks
(``mnist.py``, ``lm.py``, ``check_step.py``, ``ablation.py``, ``robustness.py``,
``public_models.py``)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Callable, Union

import numpy as np

import thor_optax

Checks = Union[int, tuple[int, int, int]]


def check_schedule(checks: Checks, min_interval: int = 1) -> thor_optax.CheckSchedule:
  """A fixed interval (int) or THOR's ``growing_interval(start, end, transition)`` (triple),
  never shorter than ``min_interval`` steps."""
  if isinstance(checks, int):
    return thor_optax.CheckSchedule(checks, min_interval)
  return thor_optax.CheckSchedule(thor_optax.growing_interval(*checks), min_interval)


def add_lapack_threads_option(p: argparse.ArgumentParser) -> None:
  """``--lapack-threads``: threads of the LAPACK library jaxlib calls on CPU."""
  p.add_argument("--lapack-threads", type=int, default=1,
                 help="threads of the LAPACK library jaxlib calls on CPU "
                      "(thor_optax.limit_lapack_threads; its idle workers otherwise spin on the "
                      "cores the next steps need); 0 leaves it as it is (default: %(default)s)")


def apply_lapack_threads(args: argparse.Namespace) -> None:
  """Applies ``--lapack-threads`` for the rest of the process (0: nothing)."""
  if args.lapack_threads:
    thor_optax.limit_lapack_threads(args.lapack_threads)


def add_optimizer_options(p: argparse.ArgumentParser, optimizers: tuple[str, ...],
                          second_order: tuple[str, ...], lr_default: Callable[[str], str],
                          damping_default: Callable[[str], str], checks_example: str,
                          default_checks: dict, tune_split: str, tune_steps: str) -> None:
  """``--lr-NAME``, ``--NAME-damping``, ``--thor-block-size``, ``--checks`` and the ``--tune``
  options; ``lr_default`` / ``damping_default`` describe each optimizer's default in the help."""
  for name in optimizers:
    p.add_argument(f"--lr-{name}", type=float, default=None,
                   help=f"learning rate of {name} (default: {lr_default(name)})")
  for name in second_order:
    p.add_argument(f"--{name}-damping", type=float, default=None,
                   help=f"damping of {name} (default: {damping_default(name)})")
  p.add_argument("--thor-block-size", type=int, default=128,
                 help="THOR's factor block size; 0 keeps factors whole (default: %(default)s)")
  p.add_argument("--checks", nargs="+", default=[], metavar="NAME=SPEC",
                 help="check steps of a second-order optimizer: NAME=N (every N steps) or "
                      f"NAME=START,END,TRANSITION (growing_interval), e.g. {checks_example} "
                      f"(default: {default_checks})")
  p.add_argument("--tune", action="store_true",
                 help="instead of the benchmark, grid-search learning rates and damping on "
                      f"{tune_split}")
  p.add_argument("--tune-steps", type=int, default=None,
                 help=f"steps per tuning candidate (default: {tune_steps})")
  p.add_argument("--no-tune-damping", dest="tune_damping", action="store_false",
                 help="--tune: skip the damping grid")


def parse_checks(p: argparse.ArgumentParser, items: list, default_checks: dict,
                 second_order: tuple[str, ...]) -> dict:
  """``default_checks`` updated by the ``--checks NAME=SPEC`` items; a bad item is a usage
  error (``p.error`` exits)."""
  checks = dict(default_checks)
  for item in items:
    name, _, spec = item.partition("=")
    try:
      values = tuple(int(v) for v in spec.split(","))
    except ValueError:
      values = ()
    if name not in second_order or len(values) not in (1, 3):
      p.error(f"--checks {item!r}: expected NAME=N or NAME=START,END,TRANSITION with NAME in "
              f"{second_order}")
    checks[name] = values[0] if len(values) == 1 else values
  return checks


def search_rates(score: Callable[[Any], Any], base: Any, centre: float,
                 key: Callable[[Any], float]) -> dict:
  """``--tune``'s learning-rate grid at ``base``'s other settings: ``{rate: score}``.

  The rates are ``centre * 10 ** linspace(-1, 1, 7)`` (7 values over a factor of 100, rounded
  to 3 digits), each scored by ``score(dataclasses.replace(base, learning_rate=rate))``; a best
  rate (lowest ``key(score)``) on the edge of the grid is extended on that side by the grid's
  factor ``10 ** (1/3)``, up to 3 more rates, until the best one is interior.
  """
  rates = [float(f"{centre * 10 ** e:.3g}") for e in np.linspace(-1, 1, 7)]
  scores = {lr: score(dataclasses.replace(base, learning_rate=lr)) for lr in rates}
  for _ in range(3):
    lr = min(scores, key=lambda k: key(scores[k]))
    if lr not in (min(scores), max(scores)):
      break
    factor = 10 ** (1 / 3) if lr == max(scores) else 10 ** (-1 / 3)
    new = float(f"{lr * factor:.3g}")
    scores[new] = score(dataclasses.replace(base, learning_rate=new))
  return scores


def search_rate_and_damping(score: Callable[[Any], Any], base: Any, centre: float,
                            dampings: tuple[float, ...], key: Callable[[Any], float],
                            report: Callable[[float, dict], Any]) -> tuple[float, float, dict]:
  """``--tune``'s joint search of a second-order optimizer's learning rate and damping.

  The best rate moves with the damping (a smaller damping takes larger steps and wants a smaller
  rate), so a rate tuned at one damping and a damping tuned at that rate miss the joint optimum.
  This searches :func:`search_rates` at every damping of ``dampings`` (``report(damping,
  scores)`` after each), then half a decade either side of the best damping at the best rate.

  Returns:
    ``(rate, damping, {(rate, damping): score})``: the pair of lowest ``key(score)`` and every
    score.
  """
  grid = {}
  for d in dampings:
    scores = search_rates(score, dataclasses.replace(base, damping=d), centre, key)
    report(d, scores)
    grid.update({(lr, d): v for lr, v in scores.items()})
  lr, d = min(grid, key=lambda k: key(grid[k]))
  for factor in (10 ** -0.5, 10 ** 0.5):
    pair = (lr, float(f"{d * factor:.3g}"))
    grid[pair] = score(dataclasses.replace(base, learning_rate=pair[0], damping=pair[1]))
  lr, d = min(grid, key=lambda k: key(grid[k]))
  return lr, d, grid
