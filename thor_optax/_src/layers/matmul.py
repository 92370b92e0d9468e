"""Modules of any class whose call is a matrix product of the input by their own ``kernel``.

Model libraries write dense layers of their own: Hugging Face's Flax GPT-2 applies a
``FlaxConv1D`` whose ``kernel`` is stored ``(d_out, d_in)``, the PyTorch layout, and transposed
before ``lax.dot_general``; hand-written models apply ``x @ self.param('kernel', ...)``. Such a
linen module has no Flax class for a kind to match, so this kind recognises it from what its
call computes: a module whose own parameters are one rank-2 ``kernel`` (and an optional rank-1
``bias``) is traced alone, on the shapes of the call's input, and captured when its jaxpr is,
up to dtype casts, ``dot_general(x, kernel or kernel.T) (+ bias)`` contracting the input's last
axis (:func:`layout`). Anything else in the call (a scale, an activation, a second use of the
input or the weight) lists the module with the reason: the weight it applies would not be its
parameter, or the layer would be more than the product K-FAC's factors describe.

A kernel applied as stored, ``(d_in, d_out)``, is a dense layer: its statistics are
:class:`~thor_optax._src.layers.dense.DenseStats` and :mod:`dense` lays it out from its shapes,
as ``nn.Dense``'s. A kernel applied transposed, ``(d_out, d_in)``, has :class:`MatmulStats`:
its shapes alone do not say which axis is the input (a square ``(d, d)`` one least of all), so
it is laid out only from the capture's statistics, ``layers=thor_optax.captured_layers(stats)``
(the first check step raises otherwise, saying so). Its factors are a dense layer's on the
kernel's transpose.

Linen only: an NNX module's parameters are attributes of any name, read in any method.

References:
  Martens & Grosse, K-FAC, ICML 2015, section 3 (dense factors).
  Eschenhagen et al., NeurIPS 2023 (K-FAC-expand/reduce over the positions sharing a weight).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import threading
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from thor_optax._src.layers import base
from thor_optax._src.layers import dense

_CASTS = frozenset({"convert_element_type", "copy", "copy_p", "reduce_precision"})
_CALLS = frozenset({"pjit", "jit", "closed_call", "core_call", "remat", "checkpoint"})
_WORDS = {"x": "input", "kernel": "kernel", "bias": "bias", "y": "product", "y+b": "output"}
_tracing = threading.local()  # set while a module's call is traced alone (no kind matches)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MatmulStats:
  """Statistics of a module applying its ``kernel`` ``(d_out, d_in)`` transposed:
  ``y = x @ kernel.T (+ bias)``.

  Attributes:
    inputs: layer input ``a``, ``(N, ..., d_in)``; axis 0 indexes examples, further leading
      axes are positions sharing the weight.
    cotangents: output cotangents of one loss term, ``(S, N, ..., d_out)``.
    num_terms: the ``M`` loss terms ``A`` divides by when the leading axis is not them
      (static), as :class:`~thor_optax._src.layers.dense.DenseStats`'.

  Source: Martens & Grosse, K-FAC, ICML 2015 (``a``, ``g``); a type apart from ``DenseStats``
  so that a transposed kernel is never read as a stored one (this project).
  """

  inputs: jax.Array
  cotangents: jax.Array
  num_terms: Optional[int] = dataclasses.field(default=None, metadata=dict(static=True))


@contextlib.contextmanager
def _alone():
  """While a module's call is traced by :func:`layout`, no module matches this kind (the
  capture's interceptor sees the traced copy's call as a plain module's)."""
  _tracing.on = True
  try:
    yield
  finally:
    _tracing.on = False


def _params(module: nn.Module) -> dict:
  """The module's own ``params`` collection, unboxed, without the capture's channels (leaves
  named ``'~thor...'`` that the capture writes beside a layer's parameters)."""
  params = module.variables.get("params", {})
  return {k: nn.meta.unbox(v) for k, v in params.items() if not str(k).startswith("~thor")}


def own_weight(module: Any) -> Optional[tuple[tuple[int, ...], Optional[tuple[int, ...]]]]:
  """``(kernel shape, bias shape or None)`` of a bound linen module whose own parameters are a
  rank-2 ``kernel`` and optionally a ``bias`` of one of its dimensions, with no submodule
  parameters; ``None`` otherwise."""
  if not isinstance(module, nn.Module) or getattr(module, "scope", None) is None:
    return None
  try:
    leaves = _params(module)
  except Exception:  # pylint: disable=broad-except  # a scope Flax invalidated
    return None
  if not leaves or set(leaves) - {"kernel", "bias"}:
    return None
  if not all(hasattr(v, "shape") for v in leaves.values()):
    return None
  kernel, bias = leaves.get("kernel"), leaves.get("bias")
  if kernel is None or kernel.ndim != 2:
    return None
  if bias is not None and (bias.ndim != 1 or bias.shape[0] not in kernel.shape):
    return None
  return tuple(kernel.shape), (None if bias is None else tuple(bias.shape))


def layout(module: nn.Module, input_shape: tuple[int, ...]) -> tuple[Optional[bool], str]:
  """``(transposed, '')`` when ``module``'s call on an input of ``input_shape`` is
  ``x @ kernel (+ bias)`` (``transposed=False``) or ``x @ kernel.T (+ bias)`` (``True``),
  else ``(None, reason)``.

  The module, unbound, is traced alone on abstract values (no FLOPs); its jaxpr may cast the
  input, kernel and bias to floating dtypes, transpose the kernel, reshape or broadcast the
  bias, and call ``jit`` bodies, and nothing else touches them (:func:`_walk`). A ``__call__``
  taking arguments besides the input is not traced: what the call computes could depend on
  them (a ``deterministic`` flag turning dropout on)."""
  extra = list(inspect.signature(type(module).__call__).parameters)[2:]
  if extra:
    return None, (f"{type(module).__name__} holds a kernel, but its call takes arguments "
                  f"besides its input ({', '.join(extra)}), which may change what it computes; "
                  "register a layer kind for it (thor_optax.register_layer_kind)")
  params = _params(module)
  names = sorted(params)
  copy = module.clone(parent=None)

  def call(leaves, x):
    return copy.apply({"params": dict(zip(names, leaves))}, x)

  structs = [jax.ShapeDtypeStruct(params[k].shape, params[k].dtype) for k in names]
  try:
    with _alone():
      closed = jax.make_jaxpr(call)(structs, jax.ShapeDtypeStruct(input_shape, jnp.float32))
  except Exception as e:  # pylint: disable=broad-except  # any failure lists the module
    return None, (f"{type(module).__name__} holds a kernel but its call could not be traced "
                  f"alone on its input ({type(e).__name__}: {str(e)[:120]}); register a layer "
                  "kind for it (thor_optax.register_layer_kind)")
  jaxpr = closed.jaxpr
  tags = {v: (("kernel", False) if n == "kernel" else ("bias",))
          for v, n in zip(jaxpr.invars, names)}
  tags[jaxpr.invars[-1]] = ("x",)
  why = _walk(jaxpr, tags, len(input_shape))
  out = [tags.get(v) if isinstance(v, jax.extend.core.Var) else None for v in jaxpr.outvars]
  want = "y+b" if "bias" in params else "y"
  if not why and any(t and t[0] in ("kernel", "bias") for t in out):
    why = "it returns its parameters, not their product with its input (a fused layer's)"
  elif not why and (len(out) != 1 or out[0] is None or out[0][0] != want):
    why = f"its output is not the product{' plus the bias' * ('bias' in params)} alone"
  if why:
    return None, (f"{type(module).__name__} holds a kernel, but its call is not a matrix "
                  f"product of its input by it: {why}; register a layer kind for it "
                  "(thor_optax.register_layer_kind)")
  return out[0][1], ""


def _walk(jaxpr: Any, tags: dict, x_ndim: int) -> str:
  """Tags every value of ``jaxpr`` that derives from the input ``('x',)``, the kernel
  ``('kernel', swapped)``, the bias ``('bias',)``, their product ``('y', transposed)`` or the
  product plus the bias ``('y+b', transposed)``; returns why an equation does something else
  to them (``''``: nothing else)."""
  for eqn in jaxpr.eqns:
    ins = [tags.get(v) if isinstance(v, jax.extend.core.Var) else None for v in eqn.invars]
    if not any(ins):
      continue
    name, out = eqn.primitive.name, eqn.outvars
    tagged = [t for t in ins if t]
    if name in _CASTS and len(ins) == 1:
      if not jnp.issubdtype(out[0].aval.dtype, jnp.floating):
        return f"it casts the {_WORDS[ins[0][0]]} to {out[0].aval.dtype}"
      tags[out[0]] = ins[0]
    elif name in _CALLS and "jaxpr" in eqn.params:
      inner = eqn.params["jaxpr"]
      inner = getattr(inner, "jaxpr", inner)
      sub = {v: t for v, t in zip(inner.invars, ins) if t}
      why = _walk(inner, sub, x_ndim)
      if why:
        return why
      for v, w in zip(out, inner.outvars):
        if isinstance(w, jax.extend.core.Var) and w in sub:
          tags[v] = sub[w]
    elif name == "transpose" and ins[0][0] == "kernel":
      swapped = tuple(eqn.params["permutation"]) == (1, 0)
      tags[out[0]] = ("kernel", ins[0][1] != swapped)
    elif name in ("reshape", "broadcast_in_dim", "squeeze") and ins == [("bias",)]:
      before, after = eqn.invars[0].aval.shape, out[0].aval.shape
      last = (name != "broadcast_in_dim"
              or tuple(eqn.params["broadcast_dimensions"])[-1:] == (len(after) - 1,))
      if not (before and after and after[-1] == before[-1] == math.prod(before) and last):
        return f"it lays the bias {tuple(before)} out as {tuple(after)}, not along the features"
      tags[out[0]] = ("bias",)
    elif name == "dot_general" and [t[0] if t else None for t in ins] == ["x", "kernel"]:
      (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
      if lb or rb or tuple(lc) != (x_ndim - 1,) or len(rc) != 1:
        return f"its product contracts the input's axes {tuple(lc)}, not its last"
      tags[out[0]] = ("y", (rc[0] == 1) != ins[1][1])
    elif name in ("add", "add_any") and sorted(t[0] for t in tagged) == ["bias", "y"] \
        and len(tagged) == 2:
      tags[out[0]] = ("y+b", next(t[1] for t in tagged if t[0] == "y"))
    else:
      what = " and ".join(sorted({_WORDS[t[0]] for t in tagged}))
      return f"it applies {name} to the {what}"
  return ""


class Matmul(dense.Dense):
  """The ``'matmul'`` kind: a linen module of any class (none of Flax's layers, which their own
  kinds take first) whose own parameters are a rank-2 ``kernel`` and an optional ``bias``, and
  whose call is ``x @ kernel (+ bias)`` or ``x @ kernel.T (+ bias)`` (:func:`layout`), such as
  Hugging Face's ``FlaxConv1D``.

  The factors are :class:`~thor_optax._src.layers.dense.Dense`'s. A product with the kernel as
  stored gives :class:`~thor_optax._src.layers.dense.DenseStats`, laid out by the ``'dense'``
  kind; a transposed one :class:`MatmulStats`, laid out only from the capture's statistics
  (``layers=thor_optax.captured_layers(stats)``): as a matrix the weight is ``kernel.T`` with
  a bias row last, ``(d_in (+1), d_out)``.

  Listed in ``CurvatureStats.unhandled`` instead of captured: a call that is not that product
  alone (the reason names the first other operation), that cannot be traced alone on its input
  (it needs other arguments or collections), and as for ``Dense``, a 1-D input and shared uses
  the capture cannot fold.

  Raises:
    ValueError: at a check step, naming the layer, for statistics that are not
      :class:`MatmulStats` or do not fit the kernel ``(d_out, d_in)``.

  Source: Martens & Grosse, K-FAC, ICML 2015 (the factors); this project (recognising the
  product from the traced call).
  """

  name = "matmul"
  stats_type = MatmulStats
  linen_modules = ()
  nnx_modules = ()
  he_rescaled = False
  live_plan = True

  def matches(self, module: Any) -> bool:
    """A bound linen module with a rank-2 ``kernel`` of its own (:func:`own_weight`); whether
    its call is a product is the plan's question (:meth:`plan`)."""
    return not getattr(_tracing, "on", False) and own_weight(module) is not None

  def plan(self, module, methods, input_shape) -> base.Plan:
    plan = super().plan(module, methods, input_shape)
    if plan.meta is None:
      return plan
    transposed, why = layout(module, tuple(input_shape))
    return base.Plan(None, why) if transposed is None else base.Plan({"transposed": transposed})

  def make_stats(self, inputs, cotangents, *, transposed) -> Any:
    """:class:`MatmulStats` for a transposed kernel, ``DenseStats`` for a stored one."""
    return (MatmulStats if transposed else dense.DenseStats)(inputs=inputs,
                                                             cotangents=cotangents)

  def claim(self, path, shapes) -> Optional[base.Claim]:
    """Never from shapes alone (they do not say that the kernel is applied transposed)."""
    del path, shapes
    return None

  def claim_captured(self, path, shapes, hint) -> Optional[base.Claim]:
    del path, hint
    kernel = shapes.get("kernel")
    if kernel is None or len(kernel) != 2 or not base.bias_fits(shapes, kernel[:1]):
      return None
    return base.Claim(a_dim=kernel[1] + int("bias" in shapes), g_dim=kernel[0])

  def matrix_dims(self, spec: base.LayerSpec) -> tuple[int, int]:
    d_out, d_in = spec.kernel_shape
    return d_in, d_out

  def kernel_matrix(self, kernel: jax.Array) -> jax.Array:
    return kernel.T

  def kernel_from_matrix(self, matrix: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    return matrix.T.reshape(shape)

  def check_stats(self, spec, stats) -> None:
    base.LayerKind.check_stats(self, spec, stats)
    dense.check_cotangents(spec, stats)
    dense.check_inputs(spec, stats, spec.d_in)
