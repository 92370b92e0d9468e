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
"""

from __future__ import annotations

import bisect
from typing import Callable, Union

import optax

Interval = Union[int, Callable[[int], float]]


def growing_interval(start: int, end: int, transition_steps: int) -> optax.Schedule:
  """THOR's growing check interval: geometric from ``start`` to ``end`` steps.

  Args:
    start: interval (in steps) at step 0, ``>= 1``.
    end: interval (in steps) reached after ``transition_steps`` and kept after, ``>= start``.
    transition_steps: steps over which the interval grows.

  Returns:
    an optax schedule ``step -> interval`` (float; :class:`CheckSchedule` rounds it).

  Raises:
    ValueError: on ``start < 1``, ``end < start`` or ``transition_steps < 1``.
  """
  if start < 1 or end < start or transition_steps < 1:
    raise ValueError(
        f"growing_interval needs 1 <= start <= end and transition_steps >= 1, got start={start}, "
        f"end={end}, transition_steps={transition_steps}")
  return optax.exponential_decay(
      init_value=float(start), transition_steps=transition_steps,
      decay_rate=float(end) / float(start), end_value=float(end))


class CheckSchedule:
  """Decides on the host whether a step is a check step.

  Check steps are ``s_0 = 0`` and ``s_{k+1} = s_k + max(1, round(interval(s_k)))``. With an int
  ``interval = N`` this is MindSpore's ``frequency``: steps ``0, N, 2N, ...``.

  Args:
    interval: an int (fixed interval, in steps) or a schedule ``step -> interval`` such as
      :func:`growing_interval`.

  Raises:
    ValueError: if a fixed interval is smaller than 1.

  Example::

    is_check = thor_optax.CheckSchedule(thor_optax.growing_interval(2, 50, 1000))
    step_fn = check_step if is_check(step) else plain_step
  """

  def __init__(self, interval: Interval):
    if isinstance(interval, int):
      if interval < 1:
        raise ValueError(f"check interval must be >= 1 step, got {interval}")
      fixed = interval
      self._interval = lambda step: fixed
    elif callable(interval):
      self._interval = interval
    else:
      raise TypeError(f"interval must be an int or a callable of the step, got {interval!r}")
    self._steps = [0]

  def interval(self, step: int) -> int:
    """The interval, in steps, that follows a check at ``step``."""
    return max(1, int(round(float(self._interval(step)))))

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
