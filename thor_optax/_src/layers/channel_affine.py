"""Modules of any class whose call scales (and shifts) each channel of a function of the input
alone: the RMS and layer norms model libraries write themselves.

Gemma's ``RMSNorm`` returns ``x / rms(x) * (1 + scale)``, MaxText's ``y * scale``, Hugging
Face's Flax Llama and Mistral ``weight * x_hat``, T5's ``x * rsqrt(mean(x^2) + eps) * scale``,
tutorials ``gamma * (x - mean) / std + beta``; a ``LayerScale`` returns ``gamma * x``. No Flax
class says what such a module computes, so this kind recognises it from its call, traced alone
(``traced.py``): a linen or NNX module whose own parameters are one or two vectors ``(C,)`` is
captured when its jaxpr is, up to float casts and the layout of each vector along the last axis,

    ``y = x_hat * (scale + c_s) + (bias + c_b)``

with ``x_hat`` computed from the input (and constants) alone, by multiplications and divisions
of the scale (``c_s``, ``c_b``: scalar constants added to the vectors, Gemma's ``1 + scale``;
either term may be absent). Then ``dy / dscale = x_hat`` and ``dy / dbias = 1`` per channel:
the layer is a normalization layer's affine map, and its curvature is SP-NGD's unit-wise
natural gradient, the ``'norm'`` kind's (``norm.py``), from the per-example gradients
``sum_t x_hat g`` and ``sum_t g``. Capture records ``x_hat`` as the output of the module's call
with ``scale = 1 - c_s`` and ``bias = -c_b`` (:meth:`ChannelAffine.unit_affine`).

Anything else in the call (a vector used otherwise than as the scale or the shift of the output,
a scale over another axis than the last, a shift added before the scale, a vector that is not
used) lists the module with the reason. A module whose leaves are named ``scale`` and ``bias``
(by their roles) has :class:`~thor_optax._src.layers.norm.NormStats`, and the ``'norm'`` kind
lays it out from its shapes; any other has :class:`ChannelAffineStats`, whose static fields name
the leaves, laid out only from the capture's statistics (``layers=captured_layers(stats)``).

References:
  Osawa et al., "Scalable and Practical Natural Gradient", TPAMI 2020, section "Unit-wise
  natural gradient".
  Zhang & Sennrich, "Root Mean Square Layer Normalization", NeurIPS 2019, eq. 4.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, NamedTuple, Optional

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

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
    scale_grads: ``(S, N, C)`` per-example gradients of the scale, ``sum_t x_hat g`` (zeros
      without one).
    bias_grads: ``(S, N, C)`` per-example gradients of the shift, ``sum_t g`` (zeros without
      one).
    scale: the scale leaf's name, or ``None`` without one (static).
    bias: the shift leaf's name, or ``None`` without one (static).

  Source: Osawa et al., SP-NGD, TPAMI 2020 (unit-wise natural gradient); a type apart from
  ``NormStats`` (not a subclass) so that its leaves are read by name, never by the ``'norm'``
  kind's layout from shapes (this project).
  """

  scale_grads: jax.Array
  bias_grads: jax.Array
  scale: Optional[str] = dataclasses.field(default="scale", metadata=dict(static=True))
  bias: Optional[str] = dataclasses.field(default="bias", metadata=dict(static=True))


def own_channels(module: Any) -> Optional[tuple[str, ...]]:
  """The names of a bound linen module's or an NNX module's own parameters when its
  ``__call__`` takes an input and they are one or two vectors of one shape ``(C,)`` (and no
  submodule holds parameters), and it is not one of Flax's classes (the ``'norm'`` kind's, or
  ``nn.WeightNorm`` / ``nn.SpectralNorm``, whose vectors scale another layer's weight);
  ``None`` otherwise."""
  if type(module).__module__.split(".")[0] == "flax":
    return None
  if isinstance(module, nnx.Module):
    if not traced.takes_an_input(type(module)):
      return None
  elif (not isinstance(module, nn.Module) or getattr(module, "scope", None) is None
        or not traced.takes_an_input(type(module))):
    return None
  try:
    leaves = traced.own_params(module)
  except Exception:  # pylint: disable=broad-except  # a scope Flax invalidated
    return None
  shapes = {tuple(getattr(v, "shape", ())) for v in leaves.values()}
  if not 1 <= len(leaves) <= 2 or len(shapes) != 1 or len(next(iter(shapes))) != 1:
    return None
  if isinstance(module, nnx.Module) and traced.nested_params(module):  # last: it walks the graph
    return None
  return tuple(sorted(leaves))


class _Tag(NamedTuple):
  """What a value of the traced call is, in terms of the module's vectors.

  ``form``: ``'p'`` a vector (``leaf``) plus the constant ``shift``, laid out along axis
  ``pos``; ``'ys'`` ``(scale + c_s) * x_hat``; ``'fb'`` ``x_hat + (bias + c_b)``; ``'ysb'``
  both. ``scale``, ``bias``: ``(leaf, constant)`` of the terms the value holds.
  """

  form: str
  pos: int
  leaf: Optional[str] = None
  shift: float = 0.0
  scale: Optional[tuple[str, float]] = None
  bias: Optional[tuple[str, float]] = None


def _leaves(tag: _Tag) -> tuple[str, ...]:
  """The vectors a tagged value derives from."""
  return (tag.leaf,) if tag.form == "p" else tuple(t[0] for t in (tag.scale, tag.bias) if t)


def _moved(eqn: Any, pos: int) -> Optional[int]:
  """The axis a vector laid along ``pos`` lies along after a broadcast, reshape, squeeze or
  transpose, or ``None`` when it is no longer one axis of its own size."""
  before, after = eqn.invars[0].aval.shape, tuple(eqn.outvars[0].aval.shape)
  name = eqn.primitive.name
  if name == "broadcast_in_dim":
    new = eqn.params["broadcast_dimensions"][pos]
  elif name == "transpose":
    new = tuple(eqn.params["permutation"]).index(pos)
  elif name == "squeeze":
    dims = {d % len(before) for d in eqn.params["dimensions"]}
    new = None if pos in dims else pos - sum(d < pos for d in dims)
  else:  # reshape: only axes of size 1 added or dropped
    if eqn.params.get("dimensions") is not None or [n for n in before if n != 1] != [
        n for n in after if n != 1] or sum(n != 1 for n in before) > 1:
      return None
    new = (next(i for i, n in enumerate(after) if n != 1) if before[pos] != 1
           else len(after) - 1)
  return new if new is not None and after[new] == before[pos] else None


def _literal(v: Any) -> Optional[float]:
  """The value of a scalar literal operand, else ``None``."""
  if isinstance(v, jax.extend.core.Literal) and np.ndim(v.val) == 0:
    return float(v.val)
  return None


def _step(eqn: Any, ins: list) -> tuple[Optional[_Tag], str]:
  """``(tag, '')`` of the output of one equation on tagged values, else ``(None, why)``."""
  name, (a, b) = eqn.primitive.name, (ins + [None])[:2]
  first = ins[0] if ins[0] is not None else ins[1]
  if name in _MOVES and len(ins) == 1 and a.form == "p":
    pos = _moved(eqn, a.pos)
    if pos is None:
      return None, f"it lays {a.leaf!r} out otherwise than along one axis"
    return a._replace(pos=pos), ""
  if name in ("add", "sub") and len(ins) == 2 and a and a.form == "p" and b is None \
      and _literal(eqn.invars[1]) is not None:
    sign = 1.0 if name == "add" else -1.0
    return a._replace(shift=a.shift + sign * _literal(eqn.invars[1])), ""
  if name == "add" and len(ins) == 2 and b and b.form == "p" and a is None \
      and _literal(eqn.invars[0]) is not None:
    return b._replace(shift=b.shift + _literal(eqn.invars[0])), ""
  if name == "add" and len(ins) == 2 and (a is None or b is None) and first.form == "p":
    return _Tag("fb", first.pos, bias=(first.leaf, first.shift)), ""
  if name == "add" and a and b and {a.form, b.form} == {"ys", "p"}:
    ys, p = (a, b) if a.form == "ys" else (b, a)
    if p.pos != ys.pos:
      return None, f"it adds {p.leaf!r} along another axis than its scale's"
    return ys._replace(form="ysb", bias=(p.leaf, p.shift)), ""
  if (name == "mul" and len(ins) == 2 and (a is None or b is None)
      or name == "div" and a is not None and b is None) and first.form in ("p", "ys"):
    if first.form == "p":
      return _Tag("ys", first.pos, scale=(first.leaf, first.shift)), ""
    return first, ""
  leaves = sorted({n for t in ins if t for n in _leaves(t)})
  what = "its output" if any(t and t.form != "p" for t in ins) else "the vector"
  return None, f"it applies {name} to {what} ({', '.join(map(repr, leaves))})"


def _walk(jaxpr: Any, tags: dict) -> str:
  """Tags every value of ``jaxpr`` that derives from the module's vectors (:class:`_Tag`);
  returns why an equation does something else to them (``''``: nothing else)."""
  for eqn in jaxpr.eqns:
    ins = [tags.get(v) if isinstance(v, jax.extend.core.Var) else None for v in eqn.invars]
    if not any(ins):
      continue
    name, out = eqn.primitive.name, eqn.outvars
    if name in traced.CASTS and len(ins) == 1:
      dtype = out[0].aval.dtype
      if not jnp.issubdtype(dtype, jnp.floating) or jnp.dtype(dtype).itemsize < 2:
        return f"it casts {', '.join(map(repr, _leaves(ins[0])))} to {dtype}"
      tags[out[0]] = ins[0]
      continue
    if name in traced.CALLS and "jaxpr" in eqn.params:
      inner = eqn.params["jaxpr"]
      inner = getattr(inner, "jaxpr", inner)
      sub = {v: t for v, t in zip(inner.invars, ins) if t}
      why = _walk(inner, sub)
      if why:
        return why
      for v, w in zip(out, inner.outvars):
        if isinstance(w, jax.extend.core.Var) and w in sub:
          tags[v] = sub[w]
      continue
    tag, why = _step(eqn, ins)
    if why:
      return why
    size = eqn.invars[ins.index(next(t for t in ins if t))].aval.shape[
        next(t for t in ins if t).pos]
    if len(out) != 1 or out[0].aval.shape[tag.pos] != size:
      return f"its {name} spreads one entry of a vector over several channels"
    tags[out[0]] = tag
  return ""


def layout(module: Any, args: tuple, kwargs: dict) -> tuple[Optional[dict], str]:
  """``(meta, '')`` when the call of ``module`` (matched by :func:`own_channels`) with
  ``args``, ``kwargs`` (one array and Python constants) is ``x_hat * (scale + c_s) + (bias +
  c_b)`` over the last axis (module docstring), else ``(None, reason)``. ``meta``:
  ``has_scale``, ``has_bias`` (the ``'norm'`` kind's), ``scale``, ``bias`` (the leaves' names
  or ``None``) and ``scale_shift``, ``bias_shift`` (``c_s``, ``c_b``). Called during the call,
  with the module live."""
  names = list(own_channels(module))
  what = f"{type(module).__name__} holds the vector{'s' * (len(names) > 1)} {names}"
  try:
    closed, shape = traced.trace_alone(module, names, args, kwargs)
  except Exception as e:  # pylint: disable=broad-except  # any failure lists the module
    return None, (f"{what} but its call could not be traced alone on its input "
                  f"({type(e).__name__}: {str(e)[:120]}); register a layer kind for it "
                  "(thor_optax.register_layer_kind)")
  jaxpr = closed.jaxpr
  tags = {v: _Tag("p", 0, leaf=n) for v, n in zip(jaxpr.invars, names)}
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
    elif out.pos != len(shape.shape) - 1:
      why = f"it scales or shifts axis {out.pos} of its output, not the last"
  if why:
    return None, (f"{what}, but its call is not a scale and shift of each channel of a "
                  f"function of its input alone: {why}; register a layer kind for it "
                  "(thor_optax.register_layer_kind)")
  scale, bias = out.scale or (None, 0.0), out.bias or (None, 0.0)
  return dict(has_scale=scale[0] is not None, has_bias=bias[0] is not None, scale=scale[0],
              bias=bias[0], scale_shift=scale[1], bias_shift=bias[1]), ""


class _WithParams(NamedTuple):
  """An unbound linen module applied with the given parameters besides the collections the
  capture passes (``x_hat``'s copy of a :class:`ChannelAffine` layer)."""

  module: nn.Module
  params: dict

  def apply(self, variables: Mapping[str, Any], *args: Any, **kwargs: Any) -> Any:
    return self.module.apply({**variables, "params": self.params}, *args, **kwargs)


class ChannelAffine(norm.Norm):
  """The ``'channel_affine'`` kind: a linen or NNX module of any class but Flax's own (its
  normalization layers are the ``'norm'`` kind's) whose own parameters are one or
  two vectors ``(C,)``, of any names (:func:`own_channels`), and whose call on one array is
  ``x_hat * (scale + c_s) + (bias + c_b)`` over the last axis, ``x_hat`` a function of the input
  alone (:func:`layout`): Gemma's, MaxText's, T5's and Hugging Face's RMS norms, layer norms
  written by hand, ``LayerScale``.

  The curvature is the ``'norm'`` kind's unit-wise 2x2 Fisher per channel (module docstring).
  Leaves named ``scale`` and ``bias`` by their roles give
  :class:`~thor_optax._src.layers.norm.NormStats`, laid out by the ``'norm'`` kind from
  shapes; any other names :class:`ChannelAffineStats`, laid out only from the capture's
  statistics (``layers=thor_optax.captured_layers(stats)``).

  Listed in ``CurvatureStats.unhandled`` instead of captured: a call that is not that map, as
  traced with the call's input and other collections (the reason names the first other use of
  a vector), a call on something else than one array and Python constants, calls that differ,
  and as for ``'norm'``, an input without a batch axis and a layer called more than once.

  Raises:
    ValueError: at a check step, naming the layer, for statistics that are not
      :class:`~thor_optax._src.layers.norm.NormStats` of ``(S, N, C)`` gradients.

  Source: Osawa et al., SP-NGD, TPAMI 2020 (unit-wise natural gradient); this project
  (recognising the affine map from the traced call).
  """

  name = "channel_affine"
  stats_type = ChannelAffineStats
  linen_modules = ()
  nnx_modules = ()
  live_plan = True

  def matches(self, module: Any) -> bool:
    """A bound linen module or an NNX module whose own parameters are one or two vectors
    (:func:`own_channels`); whether its call is their affine map is the plan's question."""
    return not traced.tracing_alone() and own_channels(module) is not None

  def plan_call(self, module, args, kwargs) -> base.Plan:
    """Captured when the call's input is one array with a batch axis, its other arguments
    Python constants, and the module's call with them is the affine map (:func:`layout`)."""
    x = base.primary_input(args, kwargs)
    if not isinstance(x, jax.Array):
      return base.Plan(None, f"{type(module).__name__} holds vectors, but its input is a "
                       f"{type(x).__name__}, not an array")
    if jnp.ndim(x) < 2:
      return base.Plan(None, f"normalization input of shape {jnp.shape(x)} has no batch axis")
    meta, why = layout(module, args, kwargs)
    return base.Plan(meta, why)

  def unit_affine(self, module: Any, dtype: Any, meta: Mapping[str, Any]) -> Any:
    """The module with ``scale = 1 - c_s`` and ``bias = -c_b``, whose output is ``x_hat``:
    linen, an unbound clone applied with those parameters (``dtype``: unused, the module's
    own); NNX, a clone with its vectors set so."""
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

  def make_stats(self, inputs, cotangents, *, has_scale, has_bias, scale, bias, scale_shift,
                 bias_shift) -> norm.NormStats:
    """``NormStats`` for leaves named ``scale`` and ``bias`` by their roles, else
    :class:`ChannelAffineStats` naming them."""
    del scale_shift, bias_shift
    stats = super().make_stats(inputs, cotangents, has_scale=has_scale, has_bias=has_bias)
    if scale in (None, "scale") and bias in (None, "bias"):
      return stats
    return ChannelAffineStats(stats.scale_grads, stats.bias_grads, scale=scale, bias=bias)

  def claim(self, path, shapes) -> Optional[base.Claim]:
    """Never from shapes alone (which vector is the scale is in the call)."""
    del path, shapes
    return None

  def claim_captured(self, path, shapes, hint) -> Optional[base.Claim]:
    del path
    names = {n for n in hint if n is not None}
    if not names or set(shapes) != names or len(set(shapes.values())) != 1 or any(
        len(s) != 1 for s in shapes.values()):
      return None
    return base.Claim(a_dim=None, g_dim=None)

  def hint(self, stats: ChannelAffineStats) -> tuple:
    return (stats.scale, stats.bias)

  def leaf_names(self, hint: tuple) -> tuple[Optional[str], Optional[str]]:
    return tuple(hint) if hint else ("scale", "bias")
