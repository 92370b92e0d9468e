"""Full optimizers: the preconditioner chained with weight decay, momentum and a learning rate.

THOR's order (MindSpore ``nn/optim/thor.py``, ``construct``): precondition the gradient, add
weight decay to the *preconditioned* gradient, then momentum SGD (``ApplyMomentum``). Everything
after the preconditioner is optax's own.

References:
  Chen et al., "THOR", AAAI 2021; MindSpore ResNet-50 THOR recipe (polynomial learning-rate
  decay, damping ``lambda_0 * decay^(epoch / 10)``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import optax

from thor_optax._src import transform

ScalarOrSchedule = Union[float, optax.Schedule]


def _first_order_tail(learning_rate: ScalarOrSchedule, momentum: float, nesterov: bool,
                      weight_decay: float, weight_decay_mask: Any) -> list:
  # No Python branching on the numbers: optax.inject_hyperparams passes them in as arrays.
  return [optax.add_decayed_weights(weight_decay, mask=weight_decay_mask),
          optax.sgd(learning_rate, momentum=momentum, nesterov=nesterov)]


def thor(
    learning_rate: ScalarOrSchedule,
    damping: ScalarOrSchedule = 0.03,
    *,
    momentum: float = 0.9,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    weight_decay_mask: Optional[Union[Any, Callable[[Any], Any]]] = None,
    block_size: Optional[int] = 128,
    trace_thresholds: tuple[float, float] = (0.01, 0.0),
    ema_decay: Optional[float] = None,
    pi_damping: bool = False,
) -> optax.GradientTransformationExtraArgs:
  """THOR: :func:`scale_by_thor`, then weight decay, then momentum SGD.

  Args:
    learning_rate: float or optax schedule (the paper's shape:
      :func:`thor_learning_rate_schedule`).
    damping: float or schedule of the step (the paper's shape: :func:`thor_damping_schedule`).
    momentum: heavy-ball momentum (0.9 in the paper).
    nesterov: Nesterov momentum.
    weight_decay: coefficient added to the preconditioned gradient (the paper: 5e-4).
    weight_decay_mask: optax mask (tree or callable) of the parameters that decay.
    block_size, trace_thresholds, ema_decay, pi_damping: see :func:`scale_by_thor`. Under
      ``optax.inject_hyperparams`` list ``block_size`` in ``static_args``: it fixes shapes.

  Returns:
    an ``optax.GradientTransformationExtraArgs``; pass ``curvature_stats=`` to ``update`` on
    check steps.

  Raises:
    ValueError: as :func:`scale_by_thor`.
  """
  return optax.chain(
      transform.scale_by_thor(damping, block_size=block_size, trace_thresholds=trace_thresholds,
                              ema_decay=ema_decay, pi_damping=pi_damping),
      *_first_order_tail(learning_rate, momentum, nesterov, weight_decay, weight_decay_mask))


def kfac(
    learning_rate: ScalarOrSchedule,
    damping: ScalarOrSchedule = 0.03,
    *,
    momentum: float = 0.9,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    weight_decay_mask: Optional[Union[Any, Callable[[Any], Any]]] = None,
    ema_decay: Optional[float] = 0.95,
    block_size: Optional[int] = None,
    pi_damping: bool = False,
) -> optax.GradientTransformationExtraArgs:
  """K-FAC: :func:`scale_by_kfac`, then weight decay, then momentum SGD.

  Args:
    learning_rate: float or optax schedule.
    damping: float or schedule of the step.
    momentum, nesterov, weight_decay, weight_decay_mask: as :func:`thor`.
    ema_decay, block_size, pi_damping: see :func:`scale_by_kfac`.

  Returns:
    an ``optax.GradientTransformationExtraArgs``.

  Raises:
    ValueError: as :func:`scale_by_kfac`.
  """
  return optax.chain(
      transform.scale_by_kfac(damping, ema_decay=ema_decay, block_size=block_size,
                              pi_damping=pi_damping),
      *_first_order_tail(learning_rate, momentum, nesterov, weight_decay, weight_decay_mask))


def thor_learning_rate_schedule(init_value: float, decay_steps: int, power: float,
                                end_value: float = 0.0) -> optax.Schedule:
  """THOR's polynomial learning-rate decay ``lr(s) = (lr_0 - lr_end)(1 - s/S)^p + lr_end``.

  Args:
    init_value: ``lr_0``.
    decay_steps: ``S``, steps until ``end_value`` (MindSpore: ``lr_end_epoch * steps/epoch``).
    power: ``p`` (MindSpore ResNet-50: ``lr_decay`` = 4.08 to 6).
    end_value: ``lr_end``.

  Returns:
    an optax schedule (``optax.polynomial_schedule``).
  """
  return optax.polynomial_schedule(init_value, end_value, power, decay_steps)


def thor_damping_schedule(init_value: float, decay_rate: float,
                          decay_steps: int) -> optax.Schedule:
  """THOR's exponential damping decay ``lambda(s) = lambda_0 * decay_rate^(s / decay_steps)``.

  Args:
    init_value: ``lambda_0`` (MindSpore ResNet-50: 0.03).
    decay_rate: factor per ``decay_steps`` (MindSpore: 0.87 or 0.5 per 10 epochs).
    decay_steps: steps per decay period (MindSpore: 10 epochs).

  Returns:
    an optax schedule (``optax.exponential_decay``, not staircased).
  """
  return optax.exponential_decay(init_value, decay_steps, decay_rate)
