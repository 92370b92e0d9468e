"""A Flax linen ``TrainState`` whose ``apply_gradients`` takes the curvature statistics.

``flax.training.train_state.TrainState.apply_gradients(grads=...)`` calls
``tx.update(grads, opt_state, params)`` with no extra arguments, so a check step's statistics
cannot reach the preconditioner through it. :class:`TrainState` adds one keyword,
``curvature_stats``, and otherwise is Flax's class (``create``, ``replace``, serialization,
``OVERWRITE_WITH_GRADIENT`` handling all come from Flax).

References:
  Flax ``flax/training/train_state.py``.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import optax
from flax.training import train_state

from thor_optax._src import stats as stats_lib


class TrainState(train_state.TrainState):
  """Flax's ``TrainState`` with ``apply_gradients(grads=..., curvature_stats=...)``.

  Use it exactly like Flax's (subclass it to add ``batch_stats`` and the like)::

    state = TrainState.create(apply_fn=model.apply, params=params, tx=thor_optax.thor(...))
    (loss, grads), stats = capture(state.params, x, y)                # a check step
    state = state.apply_gradients(grads=grads, curvature_stats=stats)
    state = state.apply_gradients(grads=grads)                        # a plain step

  Attributes:
    step, apply_fn, params, tx, opt_state: as Flax's ``TrainState``; ``step`` counts calls of
      ``apply_gradients`` (optimizer steps).

  Raises:
    TypeError: from :meth:`apply_gradients` with statistics, if ``tx`` does not accept
      ``curvature_stats`` / ``gradient_stats``; ``create`` raises what ``tx.init`` raises.
    ValueError: from :meth:`apply_gradients`, for statistics that do not fit the parameters
      (the preconditioner's message names the layer).

  Source: Flax ``flax/training/train_state.py`` (the class it extends); this project adds the
  statistics keywords.
  """

  def apply_gradients(self, *, grads: Any,
                      curvature_stats: Optional[stats_lib.CurvatureStats] = None,
                      gradient_stats: Optional[stats_lib.CurvatureStats] = None,
                      **kwargs: Any) -> "TrainState":
    """One optimizer step: ``tx.update`` (with the statistics, if given), then apply updates.

    Args:
      grads: gradients with the structure of ``params``.
      curvature_stats: the statistics of this step's batch (``value_and_grad_with_stats``) on a
        check step, passed to ``tx.update`` as ``curvature_stats=``; ``None`` on a
        plain step.
      gradient_stats: optionally, on a check or a plain step, the statistics of the batch the
        gradient comes from (on a check step usually ``curvature_stats`` again), passed as
        ``gradient_stats=``: layers narrower in rows than in block dimensions are then
        preconditioned in sample space (cheaper; the same update).
      **kwargs: further fields to ``replace`` (as Flax's ``apply_gradients``).

    Returns:
      the new state, ``step`` incremented by one.

    Raises:
      TypeError: if ``tx`` does not accept ``curvature_stats`` (it is not built from
        ``thor_optax`` transforms or composed with ``optax.chain``).
      ValueError: from the preconditioner, for statistics of another model (the message names
        the layer).
    """
    given = {name: value for name, value in (("curvature_stats", curvature_stats),
                                             ("gradient_stats", gradient_stats))
             if value is not None}
    if not given:
      return super().apply_gradients(grads=grads, **kwargs)
    tx = self.tx
    with_stats = optax.GradientTransformationExtraArgs(
        tx.init, functools.partial(tx.update, **given))
    # Flax's apply_gradients with ``tx`` bound to the statistics; ``tx=tx`` puts the original
    # transformation back into the returned state.
    return train_state.TrainState.apply_gradients(
        self.replace(tx=with_stats), grads=grads, tx=tx, **kwargs)
