"""``scale_by_momentum_bias_correction``: full-size first steps for momentum SGD.

``optax.sgd(lr, momentum=beta)`` keeps the trace ``m_t = g_t + beta m_{t-1}`` from ``m_0 = 0``.
For a steady gradient ``g`` the trace is ``g (1 - beta^t) / (1 - beta)``: the first step is
``1 - beta`` of the steady step (a tenth at ``beta = 0.9``) and the step reaches 90% of it only
after 22 steps. Adam divides its first moment by ``1 - beta^t`` for the same reason (Kingma &
Ba, "Adam: A Method for Stochastic Optimization", ICLR 2015, section 3); optax has it as
``optax.ema(..., debias=True)``, not for ``optax.trace``. Scaling the update of step ``t``
(1-based) by

    c_t = 1 / (1 - beta^t)              (heavy-ball: the update is m_t)
    c_t = 1 / (1 - beta^(t + 1))        (Nesterov: the update is g_t + beta m_t)

makes the update of a steady gradient the steady one, ``g / (1 - beta)``, from the first step;
``c_t`` falls to within 1% of 1 after 44 steps at ``beta = 0.9`` and leaves the trace (the
state of ``optax.sgd``) as it was. Chain it after ``optax.sgd``; :func:`thor_optax.thor` does
(``debias_momentum=True``).
"""
from __future__ import annotations

from typing import Union

import jax
import jax.numpy as jnp
import optax

from thor_optax._src import static_args


def momentum_bias_correction(momentum: Union[float, jax.Array],
                             nesterov: bool = False) -> optax.Schedule:
  """The schedule ``count -> c`` of :func:`scale_by_momentum_bias_correction`.

  Args:
    momentum: ``beta`` in ``[0, 1)`` (a float, or a scalar array under
      ``optax.inject_hyperparams``).
    nesterov: the correction of Nesterov momentum (``optax.sgd(..., nesterov=True)``).

  Returns:
    an optax schedule of the 0-based update count (optax's ``count``, so step ``t = count +
    1``): scalar ``1 / (1 - beta^(count + 1))``, or ``1 / (1 - beta^(count + 2))`` with
    ``nesterov`` (float32, float64 under ``jax.enable_x64``); 1 at ``beta = 0``.
  """
  offset = 2 if nesterov else 1

  def schedule(count: jax.Array) -> jax.Array:
    dtype = jnp.result_type(float)  # float64 under jax.enable_x64, else float32
    beta = jnp.asarray(momentum, dtype)
    return 1.0 / (1.0 - beta ** (jnp.asarray(count, dtype) + offset))

  return schedule


def scale_by_momentum_bias_correction(momentum: Union[float, jax.Array],
                                      nesterov: bool = False
                                      ) -> optax.GradientTransformation:
  """Scales the update of momentum SGD by ``1 / (1 - momentum^t)``: full-size first steps.

  ``optax.chain(optax.sgd(lr, momentum=beta, nesterov=n),
  scale_by_momentum_bias_correction(beta, n))`` takes, for a steady gradient, the steady step
  ``lr g / (1 - beta)`` from the first update instead of growing to it over tens of steps (the
  module docstring has the formula). Each leaf keeps its shape and dtype.

  Args:
    momentum: ``beta`` of the ``optax.sgd`` before it, in ``[0, 1)``.
    nesterov: whether that ``optax.sgd`` has Nesterov momentum.

  Returns:
    ``optax.scale_by_schedule(momentum_bias_correction(momentum, nesterov))``, with state
    ``optax.ScaleByScheduleState`` (the update count).

  Raises:
    ValueError: for a ``momentum`` (Python or numpy scalar, 0-d array) outside ``[0, 1)``.
    TypeError: for a ``momentum`` that is no number or schedule (a string, ``None``).

  References:
    Kingma & Ba, "Adam: A Method for Stochastic Optimization", ICLR 2015, section 3
    (initialization bias correction), applied to the trace of ``optax.trace``.
  """
  static_args.check_number("scale_by_momentum_bias_correction", "momentum", momentum,
                           lambda v: 0 <= v < 1, "in [0, 1)", schedule=True)
  return optax.scale_by_schedule(momentum_bias_correction(momentum, nesterov))
