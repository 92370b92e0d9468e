"""Which steps are check steps: a host-side schedule, known without a device sync.

A check step captures statistics and lets the transform run the trace rule and refresh blocks;
every other step calls ``update`` without statistics and costs about what an SGD step costs
(MindSpore THOR compiles the same two graphs). Because the schedule is a pure function of the
integer step, the training loop decides on the host which compiled step function to call.

References:
  Chen et al., "THOR", AAAI 2021: "we gradually increase the update interval" (exact schedule not
  published; :func:`growing_interval` is geometric growth between two intervals).
  MindSpore ``train/train_thor/model_thor.py``: fixed ``frequency`` N, one second-order step
  followed by ``N - 1`` first-order steps.

:func:`curvature_budget` turns "spend at most this share of training on curvature" into the
shortest interval :class:`CheckSchedule` may use, from XLA's cost of the two compiled steps.
"""

from __future__ import annotations

import bisect
import math
import numbers
from typing import Any, Callable, NamedTuple, Union

import jax
import numpy as np
import optax

from thor_optax._src import static_args

Interval = Union[int, Callable[[int], float]]


def growing_interval(start: int, end: int, transition_steps: int) -> optax.Schedule:
  """THOR's growing check interval: geometric from ``start`` to ``end`` steps.

  Args:
    start: interval (in steps) at step 0, finite and ``>= 1``.
    end: interval (in steps) reached after ``transition_steps`` and kept after, finite and
      ``>= start``.
    transition_steps: steps over which the interval grows, finite and ``>= 1``.

  Returns:
    an optax schedule ``step -> interval`` (float; :class:`CheckSchedule` rounds it).

  Raises:
    TypeError: if an argument is not a number (Python or numpy; a string, ``None``, a bool).
    ValueError: on ``start < 1``, ``end < start``, ``transition_steps < 1``, or an argument
      that is NaN or infinite.

  Source: Chen et al., "THOR", AAAI 2021 (the update interval grows over training; the paper
  gives no formula, geometric growth is ours); MindSpore's fixed ``frequency`` is
  ``start == end``.
  """
  values = []
  for name, value in (("start", start), ("end", end), ("transition_steps", transition_steps)):
    number = static_args.real_value(value)
    if number is None:
      raise TypeError(f"thor_optax.growing_interval: {name} must be a number of steps, got "
                      f"{type(value).__name__} {value!r}.")
    values.append(number)
  first, last, steps = values
  if not (all(math.isfinite(v) for v in values) and 1 <= first <= last and steps >= 1):
    raise ValueError(
        f"thor_optax.growing_interval needs finite 1 <= start <= end and transition_steps >= 1, "
        f"got start={start}, end={end}, transition_steps={transition_steps}")
  return optax.exponential_decay(
      init_value=first, transition_steps=int(steps) if steps.is_integer() else steps,
      decay_rate=last / first, end_value=last)


def _is_int(value: Any) -> bool:
  """A Python or numpy int, not a bool."""
  return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


class CheckSchedule:
  """Decides on the host whether a step is a check step.

  Check steps are ``s_0 = 0`` and ``s_{k+1} = s_k + max(min_interval, round(interval(s_k)))``.
  With an int ``interval = N`` this is MindSpore's ``frequency``: steps ``0, N, 2N, ...``.

  Args:
    interval: an int (fixed interval, in steps) or a schedule ``step -> interval`` such as
      :func:`growing_interval`.
    min_interval: the shortest interval, in steps (default 1); e.g.
      :func:`curvature_budget`'s ``min_interval``, which keeps the checks' extra cost within a
      share of the training time whatever ``interval`` says.

  Raises:
    TypeError: if ``interval`` is neither an int (Python or numpy) nor a callable (a bool, a
      float, a string), or ``min_interval`` is not an int.
    ValueError: if a fixed interval or ``min_interval`` is smaller than 1; when a step is
      queried, if the schedule returns a value that is not a finite number (NaN, infinite).

  Source: Chen et al., "THOR", AAAI 2021 (a growing update interval); MindSpore
  ``train/train_thor/model_thor.py`` (fixed ``frequency``: one check, ``N - 1`` plain steps).

  Example::

    is_check = thor_optax.CheckSchedule(thor_optax.growing_interval(2, 50, 1000))
    step_fn = check_step if is_check(step) else plain_step
  """

  def __init__(self, interval: Interval, min_interval: int = 1):
    if _is_int(interval):
      if interval < 1:
        raise ValueError(f"thor_optax.CheckSchedule: check interval must be >= 1 step, got "
                         f"{interval}")
      fixed = int(interval)
      self._interval = lambda step: fixed
    elif callable(interval):
      self._interval = interval
    else:
      raise TypeError(f"thor_optax.CheckSchedule: interval must be an int or a callable of the "
                      f"step (e.g. growing_interval(...)), got {type(interval).__name__} "
                      f"{interval!r}")
    if not _is_int(min_interval):
      raise TypeError(f"thor_optax.CheckSchedule: min_interval must be an int >= 1 (steps), "
                      f"got {type(min_interval).__name__} {min_interval!r}")
    if min_interval < 1:
      raise ValueError(f"thor_optax.CheckSchedule: min_interval must be >= 1 step, got "
                       f"{min_interval}")
    self.min_interval = int(min_interval)
    self._steps = [0]

  def interval(self, step: int) -> int:
    """The interval, in steps, that follows a check at ``step``.

    Raises:
      ValueError: if the schedule's value is not a finite number.
    """
    value = self._interval(step)
    number = static_args.real_value(value)
    if number is None or not math.isfinite(number):
      raise ValueError(f"thor_optax.CheckSchedule: the interval schedule returned {value!r} at "
                       f"step {step}; it must return a finite number of steps.")
    return max(self.min_interval, int(round(number)))

  def _extend(self, step: int) -> None:
    while self._steps[-1] < step:
      last = self._steps[-1]
      self._steps.append(last + self.interval(last))

  def __call__(self, step: int) -> bool:
    """True if ``step`` (a Python int, 0-based) is a check step."""
    step = int(step)
    self._extend(step)
    i = bisect.bisect_left(self._steps, step)
    return i < len(self._steps) and self._steps[i] == step

  def check_steps(self, num_steps: int) -> list[int]:
    """All check steps in ``[0, num_steps)``."""
    self._extend(num_steps)
    return [s for s in self._steps if s < num_steps]


class CurvatureBudget(NamedTuple):
  """What :func:`curvature_budget` derived, from XLA's cost of the two step functions.

  Attributes:
    check_flops: FLOPs of one check step (``cost_analysis()['flops']``).
    plain_flops: FLOPs of one plain step.
    share: the largest share of the training FLOPs the checks' extra cost may take.
    min_interval: the shortest check interval, in steps, that keeps the share within
      ``share`` (pass it to :class:`CheckSchedule`).

  Raises:
    ValueError: ``spent``, for an ``interval`` that is not a number ``>= 1`` (the tuple itself
      is built by :func:`curvature_budget`, which validates ``share``).

  Source: this project (issue 15); it bounds the cost of THOR's growing interval (Chen et al.,
  AAAI 2021) and of KAISA's factor-update period (Pauloski et al., SC 2021) from below.
  """

  check_flops: float
  plain_flops: float
  share: float
  min_interval: int

  def spent(self, interval: int) -> float:
    """The share of the FLOPs the checks' extra cost takes at a check every ``interval``
    steps: ``(C - P) / (interval P + C - P)``."""
    number = static_args.real_value(interval)
    if number is None or not number >= 1:
      raise ValueError(f"thor_optax.CurvatureBudget.spent: interval must be a number of steps "
                       f">= 1, got {interval!r}")
    extra = max(self.check_flops - self.plain_flops, 0.0)
    return extra / (interval * self.plain_flops + extra)


def _flops(step: Any, which: str) -> float:
  """``cost_analysis()['flops']`` of a compiled (or lowered, then compiled) step function."""
  if isinstance(step, jax.stages.Lowered):
    step = step.compile()
  if not isinstance(step, jax.stages.Compiled):
    raise TypeError(
        f"curvature_budget: {which} must be a compiled step function, "
        f"jax.jit(step).lower(*args).compile() (or its .lower(*args)), got "
        f"{type(step).__name__}.")
  cost = step.cost_analysis()
  if isinstance(cost, (list, tuple)):  # older JAX: one dict per program
    cost = cost[0] if cost else {}
  flops = float((cost or {}).get("flops", 0.0))
  if not flops > 0:
    raise ValueError(
        f"curvature_budget: XLA reports no FLOPs for {which} on this backend "
        f"({jax.default_backend()}); pass min_interval to CheckSchedule yourself.")
  return flops


def curvature_budget(check_step: Any, plain_step: Any, share: float) -> CurvatureBudget:
  """The shortest check interval that keeps the checks' cost within ``share`` of training.

  With a check every ``k`` steps, ``k - 1`` plain steps of cost ``P`` and one check of cost
  ``C`` take ``k P + (C - P)``, of which the curvature work beyond a plain step is the share
  ``(C - P) / (k P + C - P)``; it is at most ``share`` for ``k >= (C - P)(1 - share) / (share
  P)``. ``C`` and ``P`` are the FLOPs XLA's cost analysis reports for the compiled steps:
  deterministic for a program and a backend, so the schedule is reproducible and resumes from
  a checkpoint (it is a function of the step number). It is an estimate of time: work XLA
  does not count (LAPACK factorizations on CPU are custom calls; a check refreshes only the
  blocks the trace rule selects, and its branches of fewer blocks cost less) and the speed of
  small operations differ from the FLOPs. ``benchmarks/mnist.py --budget`` prints the share
  measured in wall time next to it.

  Use the compiled steps for training, so nothing compiles twice::

    check = jax.jit(check_step).lower(params, opt_state, x, y).compile()
    plain = jax.jit(plain_step).lower(params, opt_state, x, y).compile()
    budget = thor_optax.curvature_budget(check, plain, share=0.1)
    is_check = thor_optax.CheckSchedule(thor_optax.growing_interval(2, 50, 2000),
                                        min_interval=budget.min_interval)

  Args:
    check_step: the check step, compiled (``jax.stages.Compiled``) or lowered
      (``jax.stages.Lowered``, compiled here).
    plain_step: the plain step, likewise.
    share: the largest share of the training FLOPs for the checks' extra cost, in ``(0, 1)``
      (0.1: at most 10%).

  Returns:
    a :class:`CurvatureBudget`; its ``min_interval`` (steps, ``>= 1``) is the interval floor.

  Raises:
    ValueError: if ``share`` is not in ``(0, 1)``, or XLA reports no FLOPs for a step.
    TypeError: if ``share`` is not a number (a string), or a step is not a compiled or lowered
      function.

  Source: this project (issue 15); THOR's growing interval (Chen et al., AAAI 2021) runs above
  this floor.
  """
  number = static_args.real_value(share)
  if number is None:
    raise TypeError(f"thor_optax.curvature_budget: share must be a number in (0, 1), got "
                    f"{type(share).__name__} {share!r}")
  if not 0.0 < number < 1.0:
    raise ValueError(f"thor_optax.curvature_budget: share must be in (0, 1), got {share!r}")
  share = number
  check, plain = _flops(check_step, "check_step"), _flops(plain_step, "plain_step")
  extra = max(check - plain, 0.0)
  interval = max(1, math.ceil(extra * (1.0 - share) / (share * plain) - 1e-9))
  return CurvatureBudget(check, plain, float(share), interval)
