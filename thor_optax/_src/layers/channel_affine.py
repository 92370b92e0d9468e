"""Modules of any class whose call scales (and shifts) each entry of a function of the input
alone: the RMS and layer norms model libraries write themselves, learned position embeddings.

Gemma's ``RMSNorm`` returns ``x / rms(x) * (1 + scale)``, MaxText's ``y * scale``, Hugging
Face's Flax Llama and Mistral ``weight * x_hat``, T5's ``x * rsqrt(mean(x^2) + eps) * scale``,
tutorials ``gamma * (x - mean) / std + beta``; a ``LayerScale`` returns ``gamma * x``, the
``AddPositionEmbs`` of Google's vision transformer ``inputs + pos_embedding`` (``(1, T, D)``).
No Flax class says what such a module computes, so this kind recognises it from its call, traced
alone (``traced.py``): a linen or NNX module whose own parameters are one or two arrays of one
shape is captured when its jaxpr is, up to float casts and reshapes, transposes and broadcasts
that only add, drop, move or broadcast axes of size 1,

    ``y = x_hat * (scale + c_s) + (bias + c_b)``

with ``x_hat`` computed from the input (and constants) alone, by multiplications and divisions
of the scale (``c_s``, ``c_b``: scalar constants added to the arrays, Gemma's ``1 + scale``;
either term may be absent), the arrays' axes of size above 1 along axes of the output other
than the examples' (axis 0), their axes of size 1 broadcast. Then ``dy / dscale = x_hat`` and
``dy / dbias = 1`` per entry: a normalization layer's affine map, whose curvature is SP-NGD's
unit-wise natural gradient, the ``'norm'`` kind's (``norm.py``): per entry ``c`` of the arrays
(a channel, or a position and channel), the 2x2 Fisher of the per-loss-term gradients ``sum_t
x_hat g`` and ``sum_t g``, summed over each term's positions among the output axes the entry is
shared by (``norm.per_term_grads``). Capture records
``x_hat`` as the output of the module's call with ``scale = 1 - c_s`` and ``bias = -c_b``
(:meth:`ChannelAffine.unit_affine`).

Anything else in the call (an array used otherwise than as the scale or the shift of the
output, along the examples, a shift added before the scale, an array left unused) lists the
module with the reason. Arrays ``(C,)`` named ``scale`` and ``bias`` by their roles give
:class:`~thor_optax._src.layers.norm.NormStats`, which the ``'norm'`` kind lays out from their
shapes; any other :class:`ChannelAffineStats`, naming the leaves. This kind keeps its side
curvature in the order of the leaves' names, so that it lays out from shapes alone a module
whose leaves are one or two arrays of one shape, of rank 1 or with a leading axis of size 1;
other shapes need the capture's layout (``layers=captured_layers(stats)``).

References:
  Osawa et al., "Scalable and Practical Natural Gradient", TPAMI 2020, section "Unit-wise
  natural gradient".
  Zhang & Sennrich, "Root Mean Square Layer Normalization", NeurIPS 2019, eq. 4.
  Dosovitskiy et al., "An Image is Worth 16x16 Words", ICLR 2021 (learned position embeddings).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, NamedTuple, Optional

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp

from thor_optax._src.layers import base
from thor_optax._src.layers import norm
from thor_optax._src.layers import traced

_MOVES = frozenset({"broadcast_in_dim", "reshape", "squeeze", "transpose"})


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ChannelAffineStats:
  """:class:`~thor_optax._src.layers.norm.NormStats`' fields for a module whose scale and shift
  leaves are not named ``scale`` and ``bias`` by their roles (Hugging Face's ``weight``,
  ``gamma`` and ``beta``, a ``scale`` used as a shift).

  Attributes:
    scale_grads: ``(S, N, C)`` per-loss-term gradients of the scale, ``sum_t x_hat g`` over
      each term's positions (zeros without one; ``norm.per_term_grads``).
    bias_grads: ``(S, N, C)`` per-loss-term gradients of the shift, ``sum_t g`` (zeros without
      one).
    scale: the scale leaf's name, or ``None`` without one (static).
    bias: the shift leaf's name, or ``None`` without one (static).
    ndim: the leaves' rank in one layer (static; a stack of such layers has more).

  Source: Osawa et al., SP-NGD, TPAMI 2020 (unit-wise natural gradient); a type apart from
  ``NormStats`` (not a subclass) so that its leaves are read by name, never by the ``'norm'``
  kind's layout from shapes (this project).
  """

  scale_grads: jax.Array
  bias_grads: jax.Array
  scale: Optional[str] = dataclasses.field(default="scale", metadata=dict(static=True))
  bias: Optional[str] = dataclasses.field(default="bias", metadata=dict(static=True))
  ndim: int = dataclasses.field(default=1, metadata=dict(static=True))


def own_channels(module: Any) -> Optional[tuple[str, ...]]:
  """The names of the own parameters of a module a kind of any class may take
  (:func:`traced.own_leaves`), of no Flax class (:func:`traced.flax_class`), when they are one
  or two arrays of one shape, of rank 1 or more, and no submodule holds parameters; ``None``
  otherwise."""
  leaves = None if traced.flax_class(module) else traced.own_leaves(module)
  if leaves is None:
    return None
  shapes = {tuple(v.shape) for v in leaves.values()}
  if not 1 <= len(leaves) <= 2 or len(shapes) != 1 or not next(iter(shapes)):
    return None
  if isinstance(module, nnx.Module) and traced.nested_params(module):  # last: it walks the graph
    return None
  return tuple(sorted(leaves))


class _Tag(NamedTuple):
  """What a value of the traced call is, in terms of the module's arrays.

  ``form``: ``'p'`` an array (``leaf``) plus the constant ``shift``; ``'ys'`` ``(scale + c_s)
  * x_hat``; ``'fb'`` ``x_hat + (bias + c_b)``; ``'ysb'`` both. ``axes``: the value's axes the
  arrays' axes of size above 1 lie along, in the arrays' order (their entries are shared
  over the value's other axes). ``scale``, ``bias``: ``(leaf, constant)`` of the terms the
  value holds.
  """

  form: str
  axes: tuple[int, ...]
  leaf: Optional[str] = None
  shift: float = 0.0
  scale: Optional[tuple[str, float]] = None
  bias: Optional[tuple[str, float]] = None


def _leaves(tag: _Tag) -> tuple[str, ...]:
  """The arrays a tagged value derives from."""
  return (tag.leaf,) if tag.form == "p" else tuple(t[0] for t in (tag.scale, tag.bias) if t)


def _moved(eqn: Any, axes: tuple[int, ...]) -> Optional[tuple[int, ...]]:
  """The axes an array laid along ``axes`` (of sizes above 1) lies along after a broadcast,
  reshape, squeeze or transpose, or ``None`` when they are no longer axes of their sizes."""
  before, after = eqn.invars[0].aval.shape, tuple(eqn.outvars[0].aval.shape)
  name = eqn.primitive.name
  if name == "broadcast_in_dim":
    new = [eqn.params["broadcast_dimensions"][a] for a in axes]
  elif name == "transpose":
    new = [tuple(eqn.params["permutation"]).index(a) for a in axes]
  elif name == "squeeze":
    dims = {d % len(before) for d in eqn.params["dimensions"]}
    new = [a - sum(d < a for d in dims) for a in axes]  # (axes of size 1 only are squeezed)
  else:  # reshape: only axes of size 1 added or dropped
    big_before = [i for i, n in enumerate(before) if n != 1]
    big_after = [i for i, n in enumerate(after) if n != 1]
    if eqn.params.get("dimensions") is not None or [before[i] for i in big_before] != [
        after[i] for i in big_after]:
      return None
    new = [big_after[big_before.index(a)] for a in axes]
  ok = all(after[n] == before[a] for a, n in zip(axes, new))
  return tuple(new) if ok else None


def _step(eqn: Any, ins: list) -> tuple[Optional[_Tag], str]:
  """``(tag, '')`` of the output of one equation on tagged values, else ``(None, why)``."""
  name, (a, b) = eqn.primitive.name, (ins + [None])[:2]
  first = ins[0] if ins[0] is not None else ins[1]
  if name in _MOVES and len(ins) == 1:
    axes = _moved(eqn, a.axes)
    if axes is None:
      what = repr(a.leaf) if a.form == "p" else "its output"
      return None, f"it reshapes {what} otherwise than by adding or dropping axes of size 1"
    return a._replace(axes=axes), ""
  if name in ("add", "sub") and len(ins) == 2 and a and a.form == "p" and b is None \
      and traced.scalar_literal(eqn.invars[1]) is not None:
    sign = 1.0 if name == "add" else -1.0
    return a._replace(shift=a.shift + sign * traced.scalar_literal(eqn.invars[1])), ""
  if name == "add" and len(ins) == 2 and b and b.form == "p" and a is None \
      and traced.scalar_literal(eqn.invars[0]) is not None:
    return b._replace(shift=b.shift + traced.scalar_literal(eqn.invars[0])), ""
  if name == "add" and len(ins) == 2 and (a is None or b is None) and first.form == "p":
    return _Tag("fb", first.axes, bias=(first.leaf, first.shift)), ""
  if name == "add" and a and b and {a.form, b.form} == {"ys", "p"}:
    ys, p = (a, b) if a.form == "ys" else (b, a)
    if p.leaf == ys.scale[0]:
      return None, f"it uses {p.leaf!r} both as the scale and as the shift"
    if p.axes != ys.axes:
      return None, f"it adds {p.leaf!r} along other axes than its scale's"
    return ys._replace(form="ysb", bias=(p.leaf, p.shift)), ""
  if (name == "mul" and len(ins) == 2 and (a is None or b is None)
      or name == "div" and a is not None and b is None) and first.form in ("p", "ys"):
    if first.form == "p":
      return _Tag("ys", first.axes, scale=(first.leaf, first.shift)), ""
    return first, ""
  leaves = sorted({n for t in ins if t for n in _leaves(t)})
  what = "its output" if any(t and t.form != "p" for t in ins) else "the parameter"
  return None, f"it applies {name} to {what} ({', '.join(map(repr, leaves))})"


def _walk(jaxpr: Any, tags: dict) -> str:
  """Tags every value of ``jaxpr`` that derives from the module's arrays (:class:`_Tag`);
  returns why an equation does something else to them (``''``: nothing else)."""
  for eqn in jaxpr.eqns:
    ins = [tags.get(v) if isinstance(v, jax.extend.core.Var) else None for v in eqn.invars]
    if not any(ins):
      continue
    name, out = eqn.primitive.name, eqn.outvars
    if name in traced.CASTS and len(ins) == 1:
      if not traced.float_cast(eqn):
        return f"it casts {', '.join(map(repr, _leaves(ins[0])))} to {out[0].aval.dtype}"
      tags[out[0]] = ins[0]
      continue
    if traced.is_call(eqn):
      why = traced.walk_call(eqn, ins, tags, _walk)
      if why:
        return why
      continue
    tag, why = _step(eqn, ins)
    if why:
      return why
    tags[out[0]] = tag
  return ""


def layout(module: Any, args: tuple, kwargs: dict) -> tuple[Optional[dict], str]:
  """``(meta, '')`` when the call of ``module`` (matched by :func:`own_channels`) with
  ``args``, ``kwargs`` (one array and Python constants) is ``x_hat * (scale + c_s) + (bias +
  c_b)`` (module docstring), else ``(None, reason)``. ``meta``: ``channel_axes`` (the output's
  axes the arrays' axes of size above 1 lie along, in their order), ``scale``, ``bias`` (the
  leaves' names or ``None``), ``scale_shift``, ``bias_shift`` (``c_s``, ``c_b``) and
  ``ndim`` (the leaves' rank). Called during the call, with the module live."""
  names = list(own_channels(module))
  what = f"{type(module).__name__} holds the parameter{'s' * (len(names) > 1)} {names}"
  closed, shape, why = traced.trace_or_reason(module, names, args, kwargs)
  if why:
    return None, f"{what} but {why}; register a layer kind for it (thor_optax.register_layer_kind)"
  jaxpr = closed.jaxpr
  tags = {v: _Tag("p", tuple(i for i, n in enumerate(v.aval.shape) if n != 1), leaf=leaf)
          for v, leaf in zip(jaxpr.invars, names)}
  try:
    why = _walk(jaxpr, tags)
  except Exception as e:  # pylint: disable=broad-except  # an unforeseen form lists the module
    why = f"its jaxpr could not be read ({type(e).__name__}: {str(e)[:120]})"
  out = tags.get(jaxpr.outvars[0]) if isinstance(jaxpr.outvars[0], jax.extend.core.Var) \
      else None
  if not why:
    used = sorted(t[0] for t in (out.scale, out.bias) if t) if out else []
    if not isinstance(shape, jax.ShapeDtypeStruct) or out is None or out.form == "p":
      why = "its output is not one array, its input's function scaled or shifted by them"
    elif used != sorted(names):
      why = f"its output is not scaled or shifted by {sorted(set(names) - set(used))}"
    elif 0 in out.axes:
      why = "it lays them along the examples (axis 0 of its output)"
    elif not shape.shape or shape.shape[0] != jnp.shape(base.primary_input(args, kwargs))[0]:
      why = (f"its output {tuple(shape.shape)} does not keep the examples of its input "
             f"{tuple(jnp.shape(base.primary_input(args, kwargs)))} on axis 0")
    elif isinstance(module, nn.Module) and _draws_random(jaxpr):
      why = ("it draws random numbers (dropout): the copy of it that gives x_hat cannot draw "
             "the same")
  if why:
    return None, (f"{what}, but its call is not a scale and shift of each entry of a "
                  f"function of its input alone: {why}; register a layer kind for it "
                  "(thor_optax.register_layer_kind)")
  scale, bias = out.scale or (None, 0.0), out.bias or (None, 0.0)
  return dict(channel_axes=out.axes, scale=scale[0], bias=bias[0], scale_shift=scale[1],
              bias_shift=bias[1], ndim=jaxpr.invars[0].aval.ndim), ""


def _draws_random(jaxpr: Any) -> bool:
  """Whether ``jaxpr`` (or a jaxpr inside it) draws random numbers."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name.startswith(("random_", "threefry")):
      return True
    for value in eqn.params.values():
      inner = getattr(value, "jaxpr", value)
      if hasattr(inner, "eqns") and _draws_random(inner):
        return True
  return False


def _roles(stats: Any) -> tuple[Optional[str], Optional[str]]:
  """``(scale leaf, shift leaf)`` names of statistics (``NormStats``: ``scale``, ``bias``)."""
  if isinstance(stats, ChannelAffineStats):
    return stats.scale, stats.bias
  return "scale", "bias"


class _WithParams(NamedTuple):
  """An unbound linen module applied with the given parameters besides the collections the
  capture passes (``x_hat``'s copy of a :class:`ChannelAffine` layer)."""

  module: nn.Module
  params: dict

  def apply(self, variables: Mapping[str, Any], *args: Any, **kwargs: Any) -> Any:
    return self.module.apply({**variables, "params": self.params}, *args, **kwargs)


class ChannelAffine(norm.Norm):
  """The ``'channel_affine'`` kind: a linen or NNX module of any class but Flax's own (its
  normalization layers are the ``'norm'`` kind's) whose own parameters are one or two arrays of
  one shape, of any names (:func:`own_channels`), and whose call on one array is ``x_hat *
  (scale + c_s) + (bias + c_b)``, ``x_hat`` a function of the input alone (:func:`layout`):
  Gemma's, MaxText's, T5's and Hugging Face's RMS norms, layer norms written by hand,
  ``LayerScale``, a vision transformer's ``AddPositionEmbs``. A module holding one array of
  rank 2 or more is the ``'matmul'`` kind's first; this kind plans its call when that one lists
  it.

  The curvature is the ``'norm'`` kind's unit-wise 2x2 Fisher per entry of the arrays (module
  docstring), kept in the order of the leaves' names. Arrays ``(C,)`` named ``scale`` and
  ``bias`` by their roles give :class:`~thor_optax._src.layers.norm.NormStats`, laid out by the
  ``'norm'`` kind from shapes; any other :class:`ChannelAffineStats`, laid out by this kind from
  shapes when the arrays have rank 1 or a leading axis of size 1 (:meth:`claim`), else from the
  capture's statistics (``layers=thor_optax.captured_layers(stats)``).

  Listed in ``CurvatureStats.unhandled`` instead of captured: a call that is not that map, as
  traced with the call's input and other collections (the reason names the first other use of
  an array), a call on something else than one array and Python constants, calls that differ,
  and as for ``'norm'``, an input without a batch axis and a layer called more than once.

  Raises:
    ValueError: at a check step, naming the layer, for statistics that are not ``NormStats`` or
      :class:`ChannelAffineStats` of ``(S, N, C)`` gradients, or that name leaves the layer
      does not have.

  Source: Osawa et al., SP-NGD, TPAMI 2020 (unit-wise natural gradient); this project
  (recognising the affine map from the traced call).
  """

  name = "channel_affine"
  stats_type = ChannelAffineStats
  linen_modules = ()
  nnx_modules = ()
  live_plan = True
  stacks_from_shapes = False  # a (V, D) table is no stack of V vectors (claim)

  def matches(self, module: Any) -> bool:
    """A bound linen module or an NNX module whose own parameters are one or two arrays of one
    shape (:func:`own_channels`); whether its call is their affine map is the plan's
    question."""
    return not traced.tracing_alone() and own_channels(module) is not None

  def intercepts(self, module: Any, method: str) -> bool:
    """Any method of the module's own class taking an input (``traced.layer_methods``), so
    that another kind of any class may plan it; this kind plans ``__call__``."""
    return method in traced.layer_methods(type(module))

  def plan_call(self, module, args, kwargs) -> base.Plan:
    """Captured when the call's input is one array with a batch axis, its other arguments
    Python constants, and the module's call with them is the affine map (:func:`layout`)."""
    x = base.primary_input(args, kwargs)
    if not isinstance(x, jax.Array):
      return base.Plan(None, f"{type(module).__name__} holds parameters, but its input is a "
                       f"{type(x).__name__}, not an array")
    if jnp.ndim(x) < 2:
      return base.Plan(None, f"normalization input of shape {jnp.shape(x)} has no batch axis")
    meta, why = layout(module, args, kwargs)
    return base.Plan(meta, why)

  def unit_affine(self, module: Any, dtype: Any, meta: Mapping[str, Any]) -> Any:
    """The module with ``scale = 1 - c_s`` and ``bias = -c_b``, whose output is ``x_hat``:
    linen, an unbound clone applied with those parameters (``dtype``: unused, the module's
    own); NNX, a clone with its arrays set so."""
    del dtype
    units = {meta[leaf]: unit for leaf, unit in (("scale", 1.0 - meta["scale_shift"]),
                                                 ("bias", -meta["bias_shift"]))
             if meta[leaf] is not None}
    if isinstance(module, nn.Module):
      params = {k: jnp.full_like(v, units[k]) for k, v in traced.own_params(module).items()}
      return _WithParams(module.clone(parent=None), params)
    plain = nnx.clone(module)
    for leaf, unit in units.items():
      var = getattr(plain, leaf)
      var[...] = jnp.full_like(var[...], unit)
    return plain

  def make_stats(self, inputs, cotangents, *, channel_axes, scale, bias, scale_shift,
                 bias_shift, ndim) -> Any:
    """Per-position gradients ``(S, N, P..., C)`` of each entry of the arrays from ``x_hat
    (N, ...)`` and ``g (S, N, ...)``: the output's axes but the examples and ``channel_axes``
    are the positions ``P``, the entries flattened last in the arrays' order
    (:meth:`per_loss_term` sums the positions per loss term). ``NormStats`` for arrays
    ``(C,)`` (``ndim`` 1) named ``scale`` and ``bias`` by their roles (the ``'norm'`` kind lays
    them out from their shapes), else :class:`ChannelAffineStats` naming them."""
    del scale_shift, bias_shift
    dtype = jnp.promote_types(inputs.dtype, cotangents.dtype)
    g = cotangents.astype(dtype)
    entries = tuple(a + 1 for a in channel_axes)  # in the arrays' order

    def per_entry(v):  # (S, N, ...) -> (S, N, P..., C)
      positions = tuple(i for i in range(2, v.ndim) if i not in entries)
      v = jnp.transpose(v, (0, 1) + positions + entries)
      return v.reshape(v.shape[:2 + len(positions)] + (-1,))

    bias_grads = per_entry(g)
    scale_grads = (per_entry(inputs.astype(dtype)[None] * g) if scale is not None
                   else jnp.zeros_like(bias_grads))
    if bias is None:
      bias_grads = jnp.zeros_like(bias_grads)
    if scale in (None, "scale") and bias in (None, "bias") and ndim == 1:
      return norm.NormStats(scale_grads=scale_grads, bias_grads=bias_grads)
    return ChannelAffineStats(scale_grads, bias_grads, scale=scale, bias=bias, ndim=ndim)

  def channels(self, spec: base.LayerSpec) -> int:
    """The number of entries of each array."""
    return math.prod(spec.shapes[0][1])

  def matrix_dims(self, spec: base.LayerSpec) -> tuple[int, int]:
    """``(1, C)``, as a normalization layer's (no Kronecker factors)."""
    return 1, self.channels(spec)

  def check_stats(self, spec, stats) -> None:
    """The ``'norm'`` kind's checks, and the leaves the statistics name must be the layer's.

    Raises:
      ValueError: naming the layer, for statistics of another type or shape, or naming leaves
        the layer does not have.
    """
    super().check_stats(spec, stats)
    names = {n for n in _roles(stats) if n is not None}
    if not names <= {name for name, _ in spec.shapes}:
      raise ValueError(f"the statistics for layer {spec.name!r} (leaves "
                       f"{[name for name, _ in spec.shapes]}) name the leaves {sorted(names)}: "
                       "were they captured from another model?")

  def side_statistics(self, spec, stats, dtype):
    """The ``(C, 2, 2)`` unit-wise Fisher of the per-term gradients of the layer's leaves
    in the order of their names (zeros for a second leaf it does not have): the order of its
    side curvature, whichever leaf is the scale, so that a layout from shapes alone serves."""
    self.check_stats(spec, stats)
    by_leaf = dict(zip(_roles(stats), (stats.scale_grads, stats.bias_grads)))
    zeros = jnp.zeros_like(stats.bias_grads, dtype)
    grads = [by_leaf[name].astype(dtype) if name in by_leaf else zeros
             for name, _ in spec.shapes]
    return norm.unitwise_fisher(*(grads + [zeros] * (2 - len(grads))))

  def side_precondition(self, spec, leaves, state, dtype):
    """The damped 2x2 inverse of each entry applied to the layer's leaves in the order of
    their names (:meth:`side_statistics`), flattened to ``(C,)`` and back."""
    c = self.channels(spec)
    names = [name for name, _ in spec.shapes]
    v = [leaves[n].reshape(c).astype(dtype) if n in leaves else jnp.zeros((c,), dtype)
         for n in names]
    v = jnp.stack(v + [jnp.zeros((c,), dtype)] * (2 - len(v)), -1)
    y = jnp.einsum("cij,cj->ci", state.inverse, v)
    return {n: y[:, i].reshape(leaves[n].shape).astype(leaves[n].dtype)
            for i, n in enumerate(names) if n in leaves}

  def claim(self, path, shapes) -> Optional[base.Claim]:
    """One or two leaves of one shape, rank 1 or with a leading axis of size 1 (broadcast over
    the examples, ``(1, T, D)``): side curvature only, in the order of the leaves' names, so
    that which leaf is the scale need not be known (:meth:`side_statistics`). Other shapes (a
    scale per entry of a ``(T, D)`` table) and stacks of layers (:attr:`stacks_from_shapes`)
    only from the capture's layout."""
    del path
    if not 1 <= len(shapes) <= 2 or len(set(shapes.values())) != 1:
      return None
    shape = next(iter(shapes.values()))
    if len(shape) == 1 or (len(shape) > 1 and shape[0] == 1):
      return base.Claim(a_dim=None, g_dim=None)
    return None

  def claim_captured(self, path, shapes, hint) -> Optional[base.Claim]:
    del path
    names = {n for n in hint[:2] if n is not None}
    if not names or set(shapes) != names or len(set(shapes.values())) != 1 or len(next(
        iter(shapes.values()))) != hint[2]:
      return None  # (a stack of layers: its leaves have more axes than one layer's, hint[2])
    return base.Claim(a_dim=None, g_dim=None)

  def hint(self, stats: ChannelAffineStats) -> tuple:
    return (stats.scale, stats.bias, stats.ndim)

  def leaf_names(self, hint: tuple) -> tuple[Optional[str], Optional[str]]:
    return tuple(hint[:2]) if hint else ("scale", "bias")
