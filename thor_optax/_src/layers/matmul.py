"""Modules of any class whose call is a matrix product of the input by their own weight.

Model libraries and tutorials write dense layers of their own: Hugging Face's Flax GPT-2 applies
a ``FlaxConv1D`` whose ``kernel`` is stored ``(d_out, d_in)``, the PyTorch layout, and
transposed before ``lax.dot_general``; Flax's guides write ``jnp.dot(x, self.param('kernel',
...)) + bias`` or ``x @ self.w + self.b``; the Gemma of Flax's examples projects with an
``Einsum`` module of its own, ``jnp.einsum('BTD,NDH->BTNH', x, self.w)``, MaxText with a
``DenseGeneral`` of its own, and flaxformer's (T5X's) ``DenseGeneral`` stores its kernel flat,
``(prod(in_shape), prod(features))``, reshaping it before the product. Such a module has no
Flax class for a kind to match, so this kind recognises it from what its call computes: a
linen or NNX module whose own parameters are one weight of rank 2 or more and an optional bias
of lower rank, of any names, is traced alone on the shape of the call's input, and captured
when its jaxpr is, up to float casts, transposes and reshapes that split whole axes,
``dot_general(x, w) (+ b)`` contracting the input's last axes with some of the weight's, the
bias laid along the weight's other axes (:func:`layout`). Anything else in the call (a scale,
an activation, a second use of the input or the weight) lists the module with the reason: the
weight it applies would not be its parameter, or the layer would be more than the product
K-FAC's factors describe.

As a matrix the weight, its contracted axes first (in the input's order) and its other axes,
the output features, after, is ``(d_in, d_out)``; the input's contracted axes are flattened
into ``d_in`` and the output's feature axes into ``d_out``, its other axes being positions
(:mod:`einsum`'s layout, with the weight's own names). A weight named ``kernel``, ``(d_in,
d_out)`` applied as stored, with a bias named ``bias`` if any, is ``nn.Dense``'s layer: its
statistics are :class:`~thor_optax._src.layers.dense.DenseStats` and :mod:`dense` lays it out
from its shapes. Any other has :class:`MatmulStats`, whose static fields name the weight and
bias leaves and say how their axes map to the matrix: shapes alone do not say which axes are
the input's (a square ``(d, d)`` weight least of all), so it is laid out only from the
capture's statistics, ``layers=thor_optax.captured_layers(stats)`` (the first check step raises
otherwise, saying so).

NNX modules alike: the weight and bias are the module's own ``nnx.Param`` attributes, and the
NNX capture intercepts ``__call__`` of the classes of the model's modules this kind matches.

References:
  Martens & Grosse, K-FAC, ICML 2015, section 3 (dense factors).
  Eschenhagen et al., NeurIPS 2023 (K-FAC-expand/reduce over the positions sharing a weight).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp

from thor_optax._src.layers import base
from thor_optax._src.layers import dense
from thor_optax._src.layers import einsum
from thor_optax._src.layers import traced

_WORDS = {"x": "input", "kernel": "weight", "bias": "bias", "y": "product", "y+b": "output"}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MatmulStats:
  """Statistics of a module ``y = x . w (+ b)`` that ``nn.Dense``'s layout does not describe (a
  weight applied transposed, of rank 3 or more, or leaves not named ``kernel`` / ``bias``),
  flattened to a dense layer's.

  Attributes:
    inputs: ``(N, P..., d_in)``: the layer input with its contracted axes flattened last; axis 0
      indexes examples, the axes after it are positions sharing the weight.
    cotangents: ``(S, N, P..., d_out)``: output cotangents of one loss term, positions in the
      input's order, the output features (in the weight's order) flattened last.
    kernel_perm: the weight's axes in ``(contracted..., features...)`` order, the contracted
      ones in the order of the input's axes they meet (static): ``(1, 0)`` for a ``(d_out,
      d_in)`` weight applied transposed.
    in_axes: the number of the weight's contracted axes as stored (static; the input may
      contract more, when the call splits a stored axis: ``(H * h, d) -> (H, h, d)``).
    bias_perm: the bias's axes in the order of the features they lie along (static).
    weight: the weight leaf's name (static).
    bias: the bias leaf's name, or ``None`` without one (static).
    num_terms: the ``M`` loss terms ``A`` divides by when the leading axis is not them
      (static), as :class:`~thor_optax._src.layers.dense.DenseStats`'.

  Source: Martens & Grosse, K-FAC, ICML 2015 (``a``, ``g``); a type apart from ``DenseStats``
  and ``EinsumStats`` so that such a weight is never read as ``nn.Dense``'s or ``nn.Einsum``'s
  (this project).
  """

  inputs: jax.Array
  cotangents: jax.Array
  kernel_perm: tuple[int, ...] = dataclasses.field(default=(1, 0),
                                                   metadata=dict(static=True))
  in_axes: int = dataclasses.field(default=1, metadata=dict(static=True))
  bias_perm: tuple[int, ...] = dataclasses.field(default=(0,), metadata=dict(static=True))
  weight: str = dataclasses.field(default="kernel", metadata=dict(static=True))
  bias: Optional[str] = dataclasses.field(default=None, metadata=dict(static=True))
  num_terms: Optional[int] = dataclasses.field(default=None, metadata=dict(static=True))


def own_weight(module: Any) -> Optional[tuple[str, Optional[str]]]:
  """``(weight name, bias name or None)`` of a module a kind of any class may take
  (:func:`traced.own_leaves`) whose own parameters are one weight of rank 2 or more and at most
  one bias of lower rank (at least 1) whose dimensions are among the weight's, with no
  submodule parameters; ``None`` otherwise."""
  leaves = traced.own_leaves(module)
  if leaves is None:
    return None
  names = sorted(leaves, key=lambda k: leaves[k].ndim, reverse=True)
  if not names or len(names) > 2 or leaves[names[0]].ndim < 2:
    return None
  weight, bias = names[0], (names[1] if len(names) > 1 else None)
  if bias is not None and not (
      0 < leaves[bias].ndim < leaves[weight].ndim
      and all(d in leaves[weight].shape for d in leaves[bias].shape)):
    return None
  if isinstance(module, nnx.Module) and traced.nested_params(module):  # last: it walks the graph
    return None
  return weight, bias


def layout(module: nn.Module, args: tuple, kwargs: dict) -> tuple[Optional[dict], str]:
  """``(meta, '')`` when the call of ``module`` (matched by :func:`own_weight`) with arguments
  ``args``, ``kwargs`` (one array ``x``, :func:`base.primary_input`, and Python constants such
  as an einsum equation) is a matrix product of ``x`` by the weight (+ the bias), else ``(None,
  reason)``. ``meta``: the
  :mod:`einsum` layout (``x_perm``, ``y_perm``, ``kernel_perm``, ``in_axes``, ``bias_perm``;
  :func:`_meta`) with the ``weight`` and ``bias`` leaf names. Called during the call, with the
  module live.

  The module, unbound, is traced alone on abstract values of the call's input (its shape and
  dtype; the other arguments as they are), its parameters and its other collections, with a
  key for each random stream the call has (no FLOPs): what it reads from them (a mask,
  dropout) is then in the jaxpr. The
  jaxpr may cast the input, weight and bias to floats of at least 2 bytes, transpose the
  weight and the product, split whole axes of the weight, bias and product by reshapes,
  contract the input's last axes with whole axes of the weight in one ``dot_general`` (``x @
  w``, ``x @ w.T``, ``jnp.einsum``), lay the bias along the weight's other axes and call
  ``jit`` / ``remat`` bodies, and nothing else touches them (:func:`_walk`); the output must
  be one array."""
  params = traced.own_params(module)
  weight, bias = own_weight(module)
  names = sorted(params)
  x = base.primary_input(args, kwargs)
  closed, shape, why = traced.trace_or_reason(module, names, args, kwargs)
  if why:
    return None, (f"{type(module).__name__} holds a weight but {why}; register a layer kind "
                  "for it (thor_optax.register_layer_kind)")
  jaxpr = closed.jaxpr
  whole = lambda v: tuple((j, 0, 1) for j in range(v.aval.ndim))  # noqa: E731
  tags = {v: ("kernel", whole(v)) if n == weight else ("bias", whole(v), v.aval.ndim)
          for v, n in zip(jaxpr.invars, names)}
  tags[jaxpr.invars[len(names)]] = ("x",)
  try:
    why = _walk(jaxpr, tags, jnp.ndim(x))
  except Exception as e:  # pylint: disable=broad-except  # an unforeseen form lists the module
    why = f"its jaxpr could not be read ({type(e).__name__}: {str(e)[:120]})"
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
  return dict(_meta(out[0], jnp.ndim(x)), weight=weight, bias=bias), ""


def _meta(tag: tuple, x_ndim: int) -> dict:
  """The :mod:`einsum` layout of a product tagged ``('y', axes, contracted, x_in_axes)`` or
  ``('y+b', axes, contracted, x_in_axes, bias_of)`` by :func:`_walk`: the input as it is (its
  ``x_in_axes`` contracted axes are its last), the output's positions then the features (the
  weight's other axes, in its order, each split one's pieces in order) as ``y_perm``, the
  weight's contracted then feature axes as ``kernel_perm`` and the number contracted as
  ``in_axes``, and the bias's axes along the features as ``bias_perm``."""
  axes, contracted, x_in_axes = tag[1], tag[2], tag[3]
  pieces = sorted(label for kind, label in axes if kind == "w")
  features = sorted({j for j, _, _ in pieces})
  bias_of = dict(tag[4]) if tag[0] == "y+b" else {}
  return dict(x_perm=tuple(range(x_ndim)),
              y_perm=tuple(axes.index(("x", i)) for i in range(x_ndim - x_in_axes))
              + tuple(axes.index(("w", label)) for label in pieces),
              kernel_perm=tuple(contracted) + tuple(features), in_axes=len(contracted),
              x_in_axes=x_in_axes,
              bias_perm=tuple(bias_of[j] for j in features) if bias_of else ())


def _walk(jaxpr: Any, tags: dict, x_ndim: int) -> str:
  """Tags every value of ``jaxpr`` that derives from the input ``('x',)``, the weight
  ``('kernel', pieces)``, the bias ``('bias', pieces, rank)``, their product ``('y', axes,
  contracted, x_in_axes)`` or the product plus the bias ``('y+b', axes, contracted, x_in_axes,
  bias_of)``; returns why an equation does something else to them (``''``: nothing else).

  A piece ``(j, i, n)`` is the ``i``-th of the ``n`` axes a reshape split the weight's (or
  bias's) stored axis ``j`` into (``(j, 0, 1)``: the axis itself), ``None`` an axis the bias
  is broadcast along. The product's ``axes`` are ``('x', i)`` (the input's axis ``i``) or
  ``('w', piece)`` (a weight axis not contracted), ``contracted`` the weight's stored axes
  contracted, in the order of the input's axes they meet, ``x_in_axes`` the number of the
  input's (last) axes contracted, and ``bias_of`` pairs each feature axis of the weight with
  the bias's axis along it."""
  for eqn in jaxpr.eqns:
    ins = [tags.get(v) if isinstance(v, jax.extend.core.Var) else None for v in eqn.invars]
    if not any(ins):
      continue
    name, out = eqn.primitive.name, eqn.outvars
    tagged = [t for t in ins if t]
    kinds = [t[0] if t else None for t in ins]
    before = eqn.invars[0].aval.shape
    after = tuple(out[0].aval.shape) if out else ()  # (a debug callback has no output)
    if name in traced.CASTS and len(ins) == 1:
      if not traced.float_cast(eqn):
        return f"it casts the {_WORDS[ins[0][0]]} to {out[0].aval.dtype}"
      tags[out[0]] = ins[0]
    elif traced.is_call(eqn):
      why = traced.walk_call(eqn, ins, tags, lambda body, sub: _walk(body, sub, x_ndim))
      if why:
        return why
    elif name == "transpose" and kinds[0] in ("kernel", "y", "y+b"):
      t = ins[0]
      tags[out[0]] = (t[0], tuple(t[1][p] for p in eqn.params["permutation"])) + t[2:]
    elif name == "reshape" and kinds[0] in ("kernel", "y", "y+b") and len(tagged) == 1:
      t = ins[0]
      split = _split if t[0] == "kernel" else _split_product
      axes = split(t[1], before, after, eqn.params.get("dimensions"))
      if axes is None:
        return (f"it reshapes the {_WORDS[t[0]]} {tuple(before)} to {tuple(after)} other than "
                "by splitting whole axes")
      tags[out[0]] = (t[0], axes) + t[2:]
    elif name in ("reshape", "broadcast_in_dim", "squeeze", "expand_dims") \
        and kinds[0] == "bias" and len(tagged) == 1:
      axes = _bias_axes(eqn, ins[0][1])
      if axes is None:
        return f"it lays the bias {tuple(before)} out as {tuple(after)}, not along the features"
      tags[out[0]] = ("bias", axes, ins[0][2])
    elif name == "dot_general" and kinds in (["x", "kernel"], ["kernel", "x"]):
      tag, why = _product(eqn, ins, x_ndim)
      if why:
        return why
      tags[out[0]] = tag
    elif name in ("add", "add_any") and sorted(map(str, kinds)) == ["bias", "y"]:
      y, b = sorted(zip(kinds, ins, eqn.invars), key=lambda t: t[0] != "y")
      bias_of, why = _bias_along(y[1][1], b[1], y[2].aval.shape, b[2].aval.shape)
      if why:
        return why
      tags[out[0]] = ("y+b",) + y[1][1:] + (bias_of,)
    else:
      what = " and ".join(sorted({_WORDS[t[0]] for t in tagged}))
      return f"it applies {name} to the {what}"
  return ""


def _split(labels: tuple, before: tuple, after: tuple, dimensions: Any) -> Optional[tuple]:
  """The pieces at each axis of a row-major reshape ``before -> after`` of a value whose axes
  are ``labels`` (pieces ``(j, i, n)``) that splits whole axes into consecutive ones (of which
  some may have size 1) and keeps the others (flaxformer's ``(d_in, H * h) -> (d_in, H, h)``
  kernel), else ``None``: a merge, a transposing reshape (``dimensions``), an axis dropped."""
  if dimensions is not None and tuple(dimensions) != tuple(range(len(before))):
    return None
  out, k = [], 0
  for at, (label, n) in enumerate(zip(labels, before)):
    if n == 1:  # kept as an axis of size 1
      if k == len(after) or after[k] != 1:
        return None
      out.append(label)
      k += 1
      continue
    sizes = []
    while k < len(after) and (math.prod(sizes) < n or (after[k] == 1 and at == len(before) - 1)):
      sizes.append(after[k])
      k += 1
    if math.prod(sizes) != n:
      return None
    if len(sizes) == 1:
      out.append(label)
    elif label is not None and label[1:] == (0, 1):
      out.extend((label[0], i, len(sizes)) for i in range(len(sizes)))
    else:
      return None
  return tuple(out) if k == len(after) else None


def _split_product(axes: tuple, before: tuple, after: tuple, dimensions: Any
                   ) -> Optional[tuple]:
  """:func:`_split` of a product's ``axes`` (``('x', i)`` kept whole, ``('w', piece)`` split):
  ``(x @ w).reshape(N, T, H, h)``."""
  split = _split(tuple(label if kind == "w" else None for kind, label in axes), before, after,
                 dimensions)
  if split is None:
    return None
  xs = iter(a for a in axes if a[0] == "x")
  return tuple(next(xs) if p is None else ("w", p) for p in split)


def _product(eqn: Any, ins: list, x_ndim: int) -> tuple[Optional[tuple], str]:
  """``(('y', axes, contracted, x_in_axes), '')`` for a ``dot_general`` of the input and the
  weight (in either order) with no batch axes that contracts the input's last axes with whole
  weight axes, each in its pieces' order, else ``(None, why)``."""
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  x_first = ins[0][0] == "x"
  xc, wc = (lc, rc) if x_first else (rc, lc)
  w_axes = ins[1 if x_first else 0][1]
  last = tuple(range(x_ndim - len(xc), x_ndim))
  if lb or rb or tuple(sorted(xc)) != last or len(xc) >= x_ndim:
    return None, (f"its product contracts the input's axes {tuple(xc)}"
                  f"{' over batch axes' if lb else ''}, not its last ones")
  met = [w_axes[j] for _, j in sorted(zip(xc, wc))]  # pieces, in the input's order
  contracted = tuple(dict.fromkeys(j for j, _, _ in met))
  count = {j: n for j, _, n in met}
  if met != [(j, i, count[j]) for j in contracted for i in range(count[j])]:
    return None, "its product contracts parts of the weight's axes, or them out of order"
  x_free = [("x", i) for i in range(x_ndim - len(xc))]
  w_free = [("w", w_axes[j]) for j in range(len(w_axes)) if j not in wc]
  if any(p[0] in contracted for _, p in w_free):
    return None, "its product contracts parts of the weight's axes, or them out of order"
  return ("y", tuple(x_free + w_free if x_first else w_free + x_free), contracted,
          len(xc)), ""


def _bias_axes(eqn: Any, axes: tuple) -> Optional[tuple]:
  """The bias's piece (or ``None``) at each axis of a reshape / broadcast / squeeze /
  expand_dims of it, or ``None`` when it does more than add or drop axes of size 1, broadcast
  (in order) and split whole axes (:func:`_split`)."""
  before, after = eqn.invars[0].aval.shape, tuple(eqn.outvars[0].aval.shape)
  if eqn.primitive.name == "broadcast_in_dim":
    dims = tuple(eqn.params["broadcast_dimensions"])
    if list(dims) != sorted(dims):
      return None
    new = [None] * len(after)
    for k, d in enumerate(dims):
      new[d] = axes[k] if before[k] == after[d] else None
    return tuple(new)
  dimensions = eqn.params.get("dimensions")
  if dimensions is not None and tuple(dimensions) != tuple(range(len(before))):
    return None
  kept = [(n, a) for n, a in zip(before, axes) if n != 1]
  if [n for n, _ in kept] != [n for n in after if n != 1]:
    return _split(axes, before, after, None) if eqn.primitive.name == "reshape" else None
  if len(after) >= len(before) and after[len(after) - len(before):] == tuple(before):
    return (None,) * (len(after) - len(before)) + tuple(axes)  # leading axes of size 1 added
  it = iter(a for _, a in kept)
  return tuple(None if n == 1 else next(it) for n in after)


def _bias_along(y_axes: tuple, bias: tuple, y_shape: tuple, b_shape: tuple
                ) -> tuple[Optional[tuple], str]:
  """``(bias_of, '')``, the bias's stored axis along each feature axis of the weight, when the
  bias added to the product lies along all its features (split alike) and nothing else, else
  ``(None, why)``."""
  b_axes, rank = bias[1], bias[2]
  if len(b_axes) != len(y_axes):
    return None, "it adds the bias at a rank other than the product's"
  bias_of = {}
  for (kind, label), a, n, m in zip(y_axes, b_axes, y_shape, b_shape):
    if a is not None and m == n:
      if kind != "w":
        return None, "it adds the bias along the input's positions, not the features"
      if a[1:] != label[1:] or bias_of.setdefault(label[0], a[0]) != a[0]:
        return None, "its bias is laid out otherwise than the features it is added to"
    elif kind == "w":
      return None, "it adds a bias broadcast over some of the output features"
  if sorted(bias_of.values()) != list(range(rank)):
    return None, "its bias has axes that do not lie along the output features"
  return tuple(sorted(bias_of.items())), ""


class Matmul(einsum.Einsum):
  """The ``'matmul'`` kind: a linen or NNX module of any class (none of Flax's layers, which
  their own kinds take first) whose own parameters are one weight of rank 2 or more and an
  optional bias of lower rank, of any names, whose ``__call__`` takes an input
  (:func:`own_weight`), and whose call on one array (and Python constants: an equation) is a
  matrix product of it by the weight (+ the bias): ``x @ w``, ``x @ w.T``,
  ``jnp.einsum('BTD,NDH->BTNH', x, w)`` (:func:`layout`). Hugging Face's ``FlaxConv1D``, the
  ``SimpleDense`` of Flax's guides, the ``Einsum`` of Flax's Gemma example (NNX, the equation
  an attribute) and of Gemma's linen code (``Einsum(eqn, x)``), MaxText's ``DenseGeneral``.

  The factors are :class:`~thor_optax._src.layers.dense.Dense`'s on the weight as a ``(d_in,
  d_out)`` matrix, laid out as :class:`~thor_optax._src.layers.einsum.Einsum` lays out a
  kernel (module docstring). A weight named ``kernel``, ``(d_in, d_out)`` applied as stored
  (with a bias named ``bias``, if any) gives
  :class:`~thor_optax._src.layers.dense.DenseStats`, laid out by the ``'dense'`` kind; any
  other :class:`MatmulStats`, laid out only from the capture's statistics
  (``layers=thor_optax.captured_layers(stats)``).

  Listed in ``CurvatureStats.unhandled`` instead of captured: a call that is not that product
  alone, as traced with the call's input, random streams and other collections (the reason
  names the first other operation; a module whose ``__call__`` takes no argument is not
  matched at all and is listed as a kind not supported), a call on something else than one
  array and Python constants (a second array, a tuple), calls that differ (a shared module
  whose calls are not all the same product), and as for ``Dense``, a 1-D input and shared uses
  the capture cannot fold.

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
  live_plan = True

  def matches(self, module: Any) -> bool:
    """A bound linen module or an NNX module with one weight of its own
    (:func:`own_weight`); whether its call is a product is the plan's question
    (:meth:`plan_call`)."""
    return not traced.tracing_alone() and own_weight(module) is not None

  def plan(self, module, methods, input_shape) -> base.Plan:
    """A dense layer's: the input needs an example axis."""
    return dense.Dense.plan(self, module, methods, input_shape)

  def intercepts(self, module: Any, method: str) -> bool:
    """Any method of the module's own class taking an input (``traced.layer_methods``), so
    that another kind of any class may plan it; this kind plans ``__call__``."""
    return method in traced.layer_methods(type(module))

  def plan_call(self, module, args, kwargs) -> base.Plan:
    """Captured when the call's input is one array with an example axis, its other arguments
    Python constants (an einsum equation), and the module's call with them is the product
    (:func:`layout`)."""
    x = base.primary_input(args, kwargs)
    if not isinstance(x, jax.Array):
      return base.Plan(None, f"{type(module).__name__} holds a weight, but its input is a "
                       f"{type(x).__name__}, not an array")
    plan = self.plan(module, ("__call__",), jnp.shape(x))
    if plan.meta is None:
      return plan
    meta, why = layout(module, args, kwargs)
    return base.Plan(meta, why)

  def make_stats(self, inputs, cotangents, *, x_perm, y_perm, kernel_perm, in_axes, x_in_axes,
                 bias_perm, weight, bias) -> Any:
    """``DenseStats`` for ``nn.Dense``'s layout, else :class:`MatmulStats` (the input's
    ``x_in_axes`` contracted axes flattened, the features in the weight's order)."""
    x, g = einsum.flattened(inputs, cotangents, x_perm, y_perm, x_in_axes)
    if (kernel_perm == (0, 1) and x_in_axes == 1 and y_perm == tuple(range(len(y_perm)))
        and weight == "kernel" and bias in (None, "bias")):
      return dense.DenseStats(inputs=x, cotangents=g)
    return MatmulStats(inputs=x, cotangents=g, kernel_perm=kernel_perm, in_axes=in_axes,
                       bias_perm=bias_perm, weight=weight, bias=bias)

  def output_positions(self, meta, out_ndim):
    """The output axes of the positions after the example axis (the input's axes not
    contracted)."""
    del out_ndim
    return tuple(meta["y_perm"][1:len(meta["x_perm"]) - meta["x_in_axes"]])

  def hint(self, stats: MatmulStats) -> tuple:
    return (stats.kernel_perm, stats.in_axes, stats.bias_perm, stats.weight, stats.bias)

  def leaf_names(self, hint: tuple) -> tuple[str, Optional[str]]:
    return hint[3], hint[4]
