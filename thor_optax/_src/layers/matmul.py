"""Modules of any class whose call is a matrix product of the input by their own weight.

Model libraries and tutorials write dense layers of their own: Hugging Face's Flax GPT-2 applies
a ``FlaxConv1D`` whose ``kernel`` is stored ``(d_out, d_in)``, the PyTorch layout, and
transposed before ``lax.dot_general``; Flax's guides write ``jnp.dot(x, self.param('kernel',
...)) + bias`` or ``x @ self.w + self.b``. Such a module has no Flax class for a kind to match,
so this kind recognises it from what its call computes: a linen or NNX module whose own
parameters are one rank-2 weight and an optional rank-1 bias, of any names, is traced alone on
the shape of the call's input, and captured when its jaxpr is, up to float casts,
``dot_general(x, w or w.T) (+ b)`` contracting the input's last axis (:func:`layout`). Anything
else in the call (a scale, an activation, a second use of the input or the weight) lists the
module with the reason: the weight it applies would not be its parameter, or the layer would be
more than the product K-FAC's factors describe.

A weight named ``kernel`` applied as stored, ``(d_in, d_out)``, with a bias named ``bias`` if
any, is ``nn.Dense``'s layer: its statistics are
:class:`~thor_optax._src.layers.dense.DenseStats` and :mod:`dense` lays it out from its shapes.
Any other (applied transposed, or named otherwise) has :class:`MatmulStats`, whose static
fields say which leaf is the weight and whether it is transposed: its shapes alone do not say
which axis is the input (a square ``(d, d)`` one least of all), so it is laid out only from the
capture's statistics, ``layers=thor_optax.captured_layers(stats)`` (the first check step raises
otherwise, saying so). Its factors are a dense layer's on the weight as ``(d_in, d_out)``.

NNX modules alike: the weight and bias are the module's own ``nnx.Param`` attributes, and the
NNX capture intercepts ``__call__`` of the classes of the model's modules this kind matches.

References:
  Martens & Grosse, K-FAC, ICML 2015, section 3 (dense factors).
  Eschenhagen et al., NeurIPS 2023 (K-FAC-expand/reduce over the positions sharing a weight).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
import threading
from typing import Any, Optional

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp

from thor_optax._src.layers import base
from thor_optax._src.layers import dense

# Identities up to the dtype (a cast to a float of at least 2 bytes: rounding to fp8 or by
# reduce_precision changes the weight applied), and calls whose body is walked.
_CASTS = frozenset({"convert_element_type", "copy", "copy_p", "name"})
_CALLS = frozenset({"pjit", "jit", "closed_call", "core_call", "remat", "remat2",
                    "checkpoint"})
_WORDS = {"x": "input", "kernel": "weight", "bias": "bias", "y": "product", "y+b": "output"}
_tracing = threading.local()  # set while a module's call is traced alone (no kind matches)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MatmulStats:
  """Statistics of a module ``y = x @ w (+ b)`` or ``x @ w.T (+ b)`` that ``nn.Dense``'s layout
  does not describe (a weight applied transposed, or leaves not named ``kernel`` / ``bias``).

  Attributes:
    inputs: layer input ``a``, ``(N, ..., d_in)``; axis 0 indexes examples, further leading
      axes are positions sharing the weight.
    cotangents: output cotangents of one loss term, ``(S, N, ..., d_out)``.
    transposed: whether the weight is stored ``(d_out, d_in)`` and applied transposed (static).
    weight: the weight leaf's name (static).
    bias: the bias leaf's name, or ``None`` without one (static).
    num_terms: the ``M`` loss terms ``A`` divides by when the leading axis is not them
      (static), as :class:`~thor_optax._src.layers.dense.DenseStats`'.

  Source: Martens & Grosse, K-FAC, ICML 2015 (``a``, ``g``); a type apart from ``DenseStats``
  so that such a weight is never read as ``nn.Dense``'s (this project).
  """

  inputs: jax.Array
  cotangents: jax.Array
  transposed: bool = dataclasses.field(default=True, metadata=dict(static=True))
  weight: str = dataclasses.field(default="kernel", metadata=dict(static=True))
  bias: Optional[str] = dataclasses.field(default=None, metadata=dict(static=True))
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


def tracing_alone() -> bool:
  """Whether a module's call is being traced alone by :func:`layout` in this thread (the NNX
  capture's interceptor then lets the traced copy's calls through)."""
  return getattr(_tracing, "on", False)


def _params(module: Any) -> dict:
  """The module's own parameters ``{name: array}``, without the capture's channels: a linen
  module's ``params`` collection, unboxed, but leaves named ``'~thor...'``; an NNX module's
  ``nnx.Param`` attributes but those named ``'_thor...'``."""
  if isinstance(module, nnx.Module):
    return {k: v.get_value() for k, v in vars(module).items()
            if isinstance(v, nnx.Param) and not k.startswith("_thor")}
  params = module.variables.get("params", {})
  return {k: nn.meta.unbox(v) for k, v in params.items() if not str(k).startswith("~thor")}


def _nested_params(module: nnx.Module) -> bool:
  """Whether an NNX module holds parameters in submodules (or containers) of its own."""
  return any(isinstance(node, nnx.Param) and len(path) > 1
             for path, node in nnx.iter_graph(module))


@functools.lru_cache(maxsize=None)
def _takes_one_input(cls: type) -> bool:
  """Whether ``cls.__call__`` takes exactly one argument besides ``self`` (no ``*args``, no
  keyword or defaulted others): a call that could take more may compute something else than
  the product traced on its input alone."""
  try:
    params = list(inspect.signature(cls.__call__).parameters.values())[1:]
  except (TypeError, ValueError):
    return False
  return len(params) == 1 and params[0].kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                 inspect.Parameter.POSITIONAL_OR_KEYWORD)


def own_weight(module: Any) -> Optional[tuple[str, Optional[str]]]:
  """``(weight name, bias name or None)`` of a bound linen module or an NNX module whose
  ``__call__`` takes one argument and whose own parameters are one rank-2 weight and at most
  one rank-1 bias of one of its dimensions, with no submodule parameters; ``None``
  otherwise."""
  if isinstance(module, nnx.Module):
    if not _takes_one_input(type(module)):
      return None
  elif (not isinstance(module, nn.Module) or getattr(module, "scope", None) is None
        or not _takes_one_input(type(module))):
    return None
  try:
    leaves = _params(module)
  except Exception:  # pylint: disable=broad-except  # a scope Flax invalidated
    return None
  if not all(hasattr(v, "shape") for v in leaves.values()):
    return None
  weights = [k for k, v in leaves.items() if v.ndim == 2]
  biases = [k for k, v in leaves.items() if v.ndim == 1]
  if len(weights) != 1 or len(biases) > 1 or len(weights) + len(biases) != len(leaves):
    return None
  weight, bias = weights[0], (biases[0] if biases else None)
  if bias is not None and leaves[bias].shape[0] not in leaves[weight].shape:
    return None
  if isinstance(module, nnx.Module) and _nested_params(module):  # last: it walks the graph
    return None
  return weight, bias


def layout(module: nn.Module, x: jax.Array) -> tuple[Optional[bool], str]:
  """``(transposed, '')`` when the call of ``module`` (matched by :func:`own_weight`) on ``x``
  is ``x @ w (+ b)`` (``transposed=False``) or ``x @ w.T (+ b)`` (``True``), else ``(None,
  reason)``. Called during the call, with the module live.

  The module, unbound, is traced alone on abstract values of the call's input (its shape and
  dtype), its parameters and its other collections, with a key for each random stream the
  call has (no FLOPs): what it reads from them (a mask, dropout) is then in the jaxpr. The
  jaxpr may cast the input, weight and bias to floats of at least 2 bytes, transpose the
  weight, lay the bias along the output features and call ``jit`` / ``remat`` bodies, and
  nothing else touches them (:func:`_walk`); the output must be one array."""
  params = _params(module)
  weight, bias = own_weight(module)
  names = sorted(params)
  try:
    with _alone():
      closed, shape = (_traced_nnx if isinstance(module, nnx.Module) else _traced_linen)(
          module, names, x)
  except Exception as e:  # pylint: disable=broad-except  # any failure lists the module
    return None, (f"{type(module).__name__} holds a weight but its call could not be traced "
                  f"alone on its input ({type(e).__name__}: {str(e)[:120]}); register a layer "
                  "kind for it (thor_optax.register_layer_kind)")
  jaxpr = closed.jaxpr
  tags = {v: (("kernel", False) if n == weight else ("bias",))
          for v, n in zip(jaxpr.invars, names)}
  tags[jaxpr.invars[len(names)]] = ("x",)
  why = _walk(jaxpr, tags, jnp.ndim(x))
  out = [tags.get(v) if isinstance(v, jax.extend.core.Var) else None for v in jaxpr.outvars]
  want = "y" if bias is None else "y+b"
  if not why and any(t and t[0] in ("kernel", "bias") for t in out):
    why = "it returns its parameters, not their product with its input (a fused layer's)"
  elif not why and (not isinstance(shape, jax.ShapeDtypeStruct) or out[0] is None
                    or out[0][0] != want):
    why = (f"its output is not one array, the product{'' if bias is None else ' plus the bias'}"
           " alone")
  if why:
    return None, (f"{type(module).__name__} holds a weight {weight!r}, but its call is not a "
                  f"matrix product of its input by it: {why}; register a layer kind for it "
                  "(thor_optax.register_layer_kind)")
  return out[0][1], ""


def _abstract(v: Any) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(jnp.shape(v), jnp.result_type(v))


def _traced_linen(module: nn.Module, names: list, x: jax.Array) -> tuple[Any, Any]:
  """``(closed jaxpr, output shape)`` of an unbound copy of a linen module applied to ``x``,
  traced from ``(parameters named `names`..., x, other collections)``, with a key for each
  random stream of the call."""
  params = _params(module)
  others = nn.meta.unbox({col: v for col, v in module.variables.items() if col != "params"})
  streams = sorted(getattr(module.scope, "rngs", None) or {})
  copy = module.clone(parent=None)

  def call(leaves, x, others):
    rngs = {name: jax.random.key(0) for name in streams}
    return copy.apply({"params": dict(zip(names, leaves)), **others}, x, rngs=rngs)

  return jax.make_jaxpr(call, return_shape=True)(
      [_abstract(params[k]) for k in names], _abstract(x), jax.tree.map(_abstract, others))


def _traced_nnx(module: nnx.Module, names: list, x: jax.Array) -> tuple[Any, Any]:
  """``(closed jaxpr, output shape)`` of a copy of an NNX module called on ``x``, traced from
  ``(parameters named `names`..., x, the module's other state)``."""
  graphdef, state = nnx.split(module)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
  keys = [tuple(str(k.key) for k in path if hasattr(k, "key")) for path, _ in leaves]
  own = [keys.index((k,)) for k in names]
  rest = [i for i in range(len(leaves)) if i not in own]

  def call(params, x, others):
    values = [None] * len(leaves)
    for i, v in zip(own + rest, list(params) + list(others)):
      values[i] = v
    return nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, values))(x)

  return jax.make_jaxpr(call, return_shape=True)(
      [_abstract(leaves[i][1]) for i in own], _abstract(x),
      [_abstract(leaves[i][1]) for i in rest])


def _walk(jaxpr: Any, tags: dict, x_ndim: int) -> str:
  """Tags every value of ``jaxpr`` that derives from the input ``('x',)``, the weight
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
      dtype = out[0].aval.dtype
      if not jnp.issubdtype(dtype, jnp.floating) or jnp.dtype(dtype).itemsize < 2:
        return f"it casts the {_WORDS[ins[0][0]]} to {dtype}"
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
  """The ``'matmul'`` kind: a linen or NNX module of any class (none of Flax's layers, which
  their own kinds take first) whose own parameters are one rank-2 weight and an optional rank-1
  bias, of any names, whose ``__call__`` takes one argument (:func:`own_weight`), and whose call
  on one array is ``x @ w (+ b)`` or ``x @ w.T (+ b)`` (:func:`layout`): Hugging Face's
  ``FlaxConv1D``, the ``SimpleDense`` of Flax's guides.

  The factors are :class:`~thor_optax._src.layers.dense.Dense`'s. A weight named ``kernel``
  applied as stored (with a bias named ``bias``, if any) gives
  :class:`~thor_optax._src.layers.dense.DenseStats`, laid out by the ``'dense'`` kind; any
  other :class:`MatmulStats`, laid out only from the capture's statistics
  (``layers=thor_optax.captured_layers(stats)``): as a matrix the weight is ``(d_in (+1),
  d_out)``, ``w`` or ``w.T`` with a bias row last.

  Listed in ``CurvatureStats.unhandled`` instead of captured: a call that is not that product
  alone, as traced with the call's input, random streams and other collections (the reason
  names the first other operation; a module whose ``__call__`` takes more arguments is not
  matched at all and is listed as a kind not supported), a call on something else than one
  array, calls that differ (a shared module whose calls are not all the same product), and
  as for ``Dense``, a 1-D input and shared uses the capture cannot fold.

  Raises:
    ValueError: at a check step, naming the layer, for statistics that are not
      :class:`MatmulStats` or do not fit the weight.

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
    """A bound linen module or an NNX module with one rank-2 weight of its own
    (:func:`own_weight`); whether its call is a product is the plan's question
    (:meth:`plan_call`)."""
    return not tracing_alone() and own_weight(module) is not None

  def plan_call(self, module, x) -> base.Plan:
    """Captured when ``x`` is one array with an example axis and the module's call on it is the
    product (:func:`layout`)."""
    if not isinstance(x, jax.Array):
      return base.Plan(None, f"{type(module).__name__} holds a weight, but its input is a "
                       f"{type(x).__name__}, not an array")
    plan = self.plan(module, ("__call__",), jnp.shape(x))
    if plan.meta is None:
      return plan
    transposed, why = layout(module, x)
    if transposed is None:
      return base.Plan(None, why)
    weight, bias = own_weight(module)
    return base.Plan({"transposed": transposed, "weight": weight, "bias": bias})

  def make_stats(self, inputs, cotangents, *, transposed, weight, bias) -> Any:
    """``DenseStats`` for ``nn.Dense``'s layout, else :class:`MatmulStats`."""
    if not transposed and weight == "kernel" and bias in (None, "bias"):
      return dense.DenseStats(inputs=inputs, cotangents=cotangents)
    return MatmulStats(inputs=inputs, cotangents=cotangents, transposed=transposed,
                       weight=weight, bias=bias)

  def hint(self, stats: MatmulStats) -> tuple:
    return (stats.transposed, stats.weight, stats.bias)

  def leaf_names(self, hint: tuple) -> tuple[str, Optional[str]]:
    _, weight, bias = hint
    return weight, bias

  def claim(self, path, shapes) -> Optional[base.Claim]:
    """Never from shapes alone (they do not say which leaf is the weight, nor its layout)."""
    del path, shapes
    return None

  def claim_captured(self, path, shapes, hint) -> Optional[base.Claim]:
    del path
    transposed, weight, bias = hint
    w = shapes.get(weight)
    if w is None or len(w) != 2 or set(shapes) != {weight} | ({bias} if bias else set()):
      return None
    d_in, d_out = (w[1], w[0]) if transposed else w
    if bias is not None and tuple(shapes[bias]) != (d_out,):
      return None
    return base.Claim(a_dim=d_in + int(bias is not None), g_dim=d_out)

  def matrix_dims(self, spec: base.LayerSpec) -> tuple[int, int]:
    transposed, weight, _ = spec.hint
    rows, cols = spec.shape(weight)
    return (cols, rows) if transposed else (rows, cols)

  def to_matrix(self, spec, leaves, dtype) -> jax.Array:
    transposed, weight, bias = spec.hint
    x = (leaves[weight].T if transposed else leaves[weight]).astype(dtype)
    if bias is not None:
      x = jnp.concatenate([x, leaves[bias].reshape(1, -1).astype(dtype)], axis=0)
    return x

  def from_matrix(self, spec, matrix, leaves) -> dict[str, jax.Array]:
    transposed, weight, bias = spec.hint
    w = matrix[:spec.d_in]
    out = {weight: (w.T if transposed else w).astype(leaves[weight].dtype)}
    if bias is not None:
      out[bias] = matrix[spec.d_in].astype(leaves[bias].dtype)
    return out

  def check_stats(self, spec, stats) -> None:
    base.LayerKind.check_stats(self, spec, stats)
    dense.check_cotangents(spec, stats)
    dense.check_inputs(spec, stats, spec.d_in)
