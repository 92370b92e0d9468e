"""Flax NNX integration: capture curvature statistics without changing the model.

``value_and_grad_with_stats(loss_fn)(model, x, y)`` returns ``((loss, grads), stats)`` from one
forward and one backward pass, with ``grads`` as ``nnx.grad`` gives them; pass ``stats`` to a
thor_optax transform as ``curvature_stats=stats``, e.g. through
``nnx.Optimizer(model, tx, wrt=nnx.Param).update(model, grads, curvature_stats=stats)``.
"""

from thor_optax._src.capture import output_cotangents
from thor_optax._src.nnx_capture import value_and_grad_with_stats

__all__ = ("output_cotangents", "value_and_grad_with_stats")
