"""Flax linen integration: capture curvature statistics without changing the model.

``value_and_grad_with_stats(model, loss_fn)(params, x, y)`` returns ``((loss, grads), stats)``
from one forward and one backward pass; pass ``stats`` to a thor_optax transform as
``curvature_stats=stats``, or to :class:`TrainState`'s ``apply_gradients(grads=...,
curvature_stats=stats)``.
"""

from thor_optax._src.capture import output_cotangents
from thor_optax._src.capture import value_and_grad_with_stats
from thor_optax._src.train_state import TrainState

__all__ = ("TrainState", "output_cotangents", "value_and_grad_with_stats")
