"""Whether a layer's input has a row per example: read from the traced model (a jaxpr).

A layer's statistics take the input's leading axis for the examples. An input that depends on
no example (a relative-position bucket table ``(T, T)``, learned latents, position ids) has rows
that are not examples unless it was broadcast to the batch before the layer, which gives each
example a row block of its own (and its cotangents). The leading axis's size cannot tell the
two apart when the table happens to have as many rows as the batch has examples (T5's
``(T, T)`` table at ``N = T``), so the capture asks the jaxpr instead:

* :func:`example_dependent`: the variables that depend on the examples (any input after the
  parameters and model state), propagated forward through every equation and into the bodies
  of called jaxprs (jitted functions); a loop's or branch's outputs all depend on the examples
  when any of its inputs does (an over-approximation, so a variable outside the set surely
  depends on no example);
* :func:`broadcast_axis`: whether an axis of a variable is a broadcast (every slice along it
  equal by construction: ``jnp.broadcast_to``, ``jnp.tile``, ``jnp.repeat`` of one row,
  ``jnp.zeros``), followed back through elementwise operations, reshapes, transposes and
  calls of jitted functions; anything else is not taken for one.

Source: this project (the capture's per-example check, ``capture.not_per_example``).
"""

from __future__ import annotations

import math
from typing import Any

from jax.extend import core as jax_core

# Primitives whose every output entry is a function of the same entry of each operand (operands
# of the output's shape or scalars).
_ELEMENTWISE = frozenset({
    "abs", "add", "and", "ceil", "clamp", "convert_element_type", "copy", "copy_p", "cos",
    "div", "eq", "erf", "exp", "exp2", "expm1", "floor", "ge", "gt", "integer_pow", "le",
    "log", "log1p", "logistic", "lt", "max", "min", "mul", "ne", "neg", "not", "or", "pow",
    "reduce_precision", "rem", "round", "rsqrt", "select_n", "sign", "sin", "sqrt", "square",
    "stop_gradient", "sub", "tanh", "xor"})
# Primitives that call a closed jaxpr on their operands (``jax.jit``-ed functions, ``jnp``
# functions written with it, custom derivatives).
_CALLS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
# Primitives whose ``jaxpr`` is a loop body: its outputs are not the equation's (a scan stacks
# them) and one pass through it does not follow the carry.
_LOOPS = frozenset({"scan", "while"})


def _called(eqn: Any) -> Any:
  """The jaxpr an equation calls once on its operands, its outputs the equation's, or ``None``
  (no sub-jaxpr, or a loop or branch)."""
  if eqn.primitive.name in _LOOPS:
    return None
  inner = next((eqn.params[k] for k in _CALLS if eqn.params.get(k) is not None), None)
  return getattr(inner, "jaxpr", inner)


def example_dependent(jaxpr: Any, given: int) -> set:
  """The variables of ``jaxpr`` that depend on its inputs after the first ``given`` (the
  examples, the call's keywords), through every equation: into the body of a called jaxpr
  (a jitted function), while a loop or branch (``scan``, ``while``, ``cond``) passes the
  dependence to all its outputs (an over-approximation)."""
  return _dependent(jaxpr, [i >= given for i in range(len(jaxpr.invars))])


def _dependent(jaxpr: Any, inputs: list[bool]) -> set:
  found = {v for v, d in zip(jaxpr.invars, inputs) if d}
  for eqn in jaxpr.eqns:
    ins = [not isinstance(v, jax_core.Literal) and v in found for v in eqn.invars]
    if not any(ins):
      continue
    inner = _called(eqn)
    if inner is None:
      found.update(eqn.outvars)
      continue
    body = _dependent(inner, ins)
    found.update(o for o, v in zip(eqn.outvars, inner.outvars)
                 if not isinstance(v, jax_core.Literal) and v in body)
  return found


def broadcast_axis(jaxpr: Any, var: Any, axis: int) -> bool:
  """Whether ``axis`` of ``var`` (a variable of ``jaxpr``) is a broadcast: the variable was
  made by broadcasting, tiling or repeating along it, so that every slice along it is equal.
  ``False`` where that cannot be read from the equations (module docstring)."""
  return _Walk().axis(jaxpr, var, axis, ())


class _Walk:
  """:func:`broadcast_axis`'s walk back through the equations, with each jaxpr's producers."""

  def __init__(self):
    self.producers: dict[int, dict] = {}
    self.steps = 0

  def producer(self, jaxpr: Any, var: Any) -> Any:
    if id(jaxpr) not in self.producers:
      self.producers[id(jaxpr)] = {o: e for e in jaxpr.eqns for o in e.outvars}
    return self.producers[id(jaxpr)].get(var)

  def axis(self, jaxpr: Any, var: Any, axis: int, outer: tuple) -> bool:
    """``outer``: ``((jaxpr, eqn), ...)`` of the calls the walk went into, innermost last, to
    follow an input of a called jaxpr back to the caller's operand."""
    self.steps += 1
    if isinstance(var, jax_core.Literal) or self.steps > 256:
      return isinstance(var, jax_core.Literal) and not var.aval.shape
    if tuple(var.aval.shape)[axis] == 1:
      return True
    eqn = self.producer(jaxpr, var)
    if eqn is None:  # an input of the jaxpr: a called one's operand, or the model's own
      if outer and any(v is var for v in jaxpr.invars):
        caller, call = outer[-1]
        i = next(i for i, v in enumerate(jaxpr.invars) if v is var)
        return self.axis(caller, call.invars[i], axis, outer[:-1])
      return False
    return self.through(jaxpr, eqn, var, axis, outer)

  def through(self, jaxpr: Any, eqn: Any, var: Any, axis: int, outer: tuple) -> bool:
    name, params, ins = eqn.primitive.name, eqn.params, eqn.invars
    follow = lambda v, a: self.axis(jaxpr, v, a, outer)
    if name == "broadcast_in_dim":
      dims = tuple(params["broadcast_dimensions"])
      return axis not in dims or follow(ins[0], dims.index(axis))
    if name in _ELEMENTWISE:
      return all(not v.aval.shape or follow(v, axis) for v in ins)
    if name == "tile":
      return follow(ins[0], axis)  # (an axis of size 1 tiled: a broadcast, read above)
    if name == "transpose":
      return follow(ins[0], tuple(params["permutation"])[axis])
    if name == "reshape" and axis == 0:
      before = tuple(ins[0].aval.shape)
      size = tuple(var.aval.shape)[0]
      k = next((k for k in range(1, len(before) + 1) if math.prod(before[:k]) == size), None)
      return k is not None and all(follow(ins[0], j) for j in range(k))
    inner = _called(eqn)
    if inner is None:
      return False
    out = inner.outvars[next(i for i, o in enumerate(eqn.outvars) if o is var)]
    return self.axis(inner, out, axis, outer + ((jaxpr, eqn),))
