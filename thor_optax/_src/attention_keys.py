"""Attention keys found in the traced model: layers whose output reaches the model's outputs only
through softmaxes over its positions.

A softmax is invariant to a shift of all its logits, so a layer whose output ``y`` ``(N, P...,
F...)`` enters the loss only as an attention key (``logits = q k^T``, softmax over the key
positions) leaves the loss unchanged when a vector ``c`` ``(N, F...)`` is added at every
position: its output cotangents sum to zero over the positions of each example, exactly.
K-FAC-reduce's ``G`` is formed from those sums, so it vanishes and the key would keep the
identity for ``G``; ``weight_sharing='auto'`` expands such a layer instead
(``capture.layer_weight_sharing``). This module finds the keys from the discovery pass's
jaxpr, for Flax's ``nn.MultiHeadDotProductAttention`` / ``nnx.MultiHeadAttention`` and
attention written by hand (Hugging Face's Flax models, forks of Flax's attention) alike; a key
by name is not one when its logits change with the shift (``normalize_qk=True``, a rotary
``attention_fn``, a sigmoid in place of the softmax).

How: the discovery pass routes each candidate layer's output through an identity ``jax.jit``
named for it (:class:`Marks`). :func:`shift_invariant` then pushes the tangent of that shift
forward through the jaxpr (and its sub-jaxprs: ``jit``, ``remat``, ``custom_jvp``, ``scan``,
``cond``), keeping for each variable only what the cancellation needs: the tangent is zero,
``c`` (additive: constant along some axes), ``y * c`` (multiplicative, after ``exp``), or
anything. The expanded softmax ``exp(z - max z) / sum exp(z - max z)`` then cancels the
tangent exactly: ``sum`` over an axis ``c`` is constant along keeps ``y * c``, and the quotient of
two ``y * c`` with the same ``c`` has tangent zero. Each call of a layer is marked on its own
(under ``vmap`` the mapped axes come first in the jaxpr); a layer is a key when no call's
tangent reaches a model output, every call marked (one without positions too: a shared
layer's pooled use). Everything not understood makes the tangent "anything", and the marks
inside a construct the analysis does not enter (a ``while`` loop) too, so a layer is not
taken for a key wrongly; one masking rule is approximate: ``where(mask, logits, fill)`` with a
constant ``fill <= -1e4`` (Flax's ``finfo.min``) keeps the shift, as the filled entries get
zero weight in the softmax that follows (filled logits used otherwise, ``z - max(z)`` as an
output, would be taken for shift invariant). Derivatives are the primal's, so a
``custom_jvp`` / ``custom_vjp`` (a straight-through estimator) counts as "anything", except
JAX's own softmax.

Source: this project; the invariance is why K-FAC-reduce's key factor vanishes (Eschenhagen et
al., "Kronecker-Factored Approximate Curvature for Modern Neural Network Architectures",
NeurIPS 2023, section 3: reduce sums the cotangents over the positions).
"""

from __future__ import annotations

import itertools
from typing import Any, NamedTuple, Optional, Sequence

import jax
from jax.extend import core as jax_core
import jax.numpy as jnp
import numpy as np

_PREFIX = "thor_optax_shift_probe_"
# Calls whose body is the same computation on the same shapes: followed inside.
_ENTERED = frozenset({"jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint",
                      "custom_jvp_call"})
_FILL = -1e4  # a masked logit at or below this has zero softmax weight (exp underflows)
_fresh = itertools.count()


class _Tangent(NamedTuple):
  """The tangent of one variable along one layer's shift: ``kind`` ``'add'`` (``c``), ``'mul'``
  (the value times ``c``) or ``'any'``; ``coef`` identifies ``c`` and ``labels`` its axes (one
  per axis of the variable, ``None`` where ``c`` is constant along it)."""

  kind: str
  coef: int = -1
  labels: tuple = ()

  def same(self, other: "_Tangent") -> bool:
    return (self.kind == other.kind != "any" and self.coef == other.coef
            and self.labels == other.labels)


_ANY = _Tangent("any")


def _fresh_like(t: _Tangent, kind: Optional[str] = None) -> _Tangent:
  """A tangent of a new ``c``, constant along the same axes as ``t``'s."""
  coef = next(_fresh)
  return _Tangent(kind or t.kind, coef,
                  tuple(None if l is None else (coef, i) for i, l in enumerate(t.labels)))


class Marks:
  """The calls of candidate layers in one discovery pass: :meth:`mark` routes a call's output
  through an identity ``jax.jit`` named for the call, whose output variable
  :func:`shift_invariant` starts from; :meth:`skip` notes a call that is not marked (its layer
  is then no key)."""

  def __init__(self):
    self.paths: dict[str, tuple[Any, ...]] = {}  # mark name -> layer path
    self.shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}  # (shape, positions)
    self.skipped: set = set()

  def mark(self, out: Any, path: tuple[Any, ...], positions: Sequence[int]) -> Any:
    """``out`` ``(N, P..., F...)`` of one call of the layer at ``path`` through an identity
    named for the call; ``positions``: the axes of ``P`` (``()``: none, the call is still
    marked, as one use of a shared layer)."""
    if not isinstance(out, jax.Array):
      self.skip(path)
      return out
    name = f"{_PREFIX}{len(self.paths)}"
    self.paths[name], self.shapes[name] = path, (tuple(out.shape), tuple(positions))

    def identity(x):
      return x

    identity.__name__ = name
    return jax.jit(identity)(out)

  def skip(self, path: tuple[Any, ...]) -> None:
    self.skipped.add(path)


def shift_invariant(jaxpr: Any, outputs: Sequence[bool], marks: Marks) -> frozenset:
  """The paths of the marked layers whose shift along their positions, at every call, reaches
  none of the ``jaxpr``'s outputs marked in ``outputs`` (the model's outputs). A call whose
  mark is not in the jaxpr was pruned by JAX (its output unused); a layer with a call not
  marked (:meth:`Marks.skip`) or inside a construct the analysis does not enter is no key."""
  if not marks.paths:
    return frozenset()
  env: dict = {}
  flow = _Flow(marks)
  _run(jaxpr, env, flow)
  reached = set(flow.anything)
  for var, is_output in zip(jaxpr.outvars, outputs):
    if is_output and not isinstance(var, jax_core.Literal):
      reached.update(env.get(var, {}))
  not_keys = {marks.paths[n] for n in reached} | marks.skipped
  return frozenset(marks.paths[n] for n in flow.seen) - not_keys


class _Flow:
  """One analysis: the marks, those seen in the jaxpr, and those whose tangent became "anything"
  (counted as reaching the outputs and no longer followed, which keeps the pass short)."""

  def __init__(self, marks: Marks):
    self.marks, self.seen, self.anything = marks, set(), set()


def _run(jaxpr: Any, env: dict, flow: _Flow, consts: Optional[dict] = None) -> None:
  """Pushes every marked layer's tangent through ``jaxpr``'s equations (``env``: ``{var: {mark
  name: _Tangent}}``, absent: zero; ``consts``: known constant values of variables)."""
  consts = {} if consts is None else consts
  for eqn in jaxpr.eqns:
    name = _mark_name(eqn, flow.marks)
    if name:
      if not eqn.outvars:  # its output dropped (a loop body pruned by JAX)
        continue
      flow.seen.add(name)
      env[eqn.outvars[0]] = {**_get(env, eqn.invars[0]), **_start(eqn, name, flow)}
      continue
    ins = [{k: t for k, t in _get(env, v).items() if k not in flow.anything}
           for v in eqn.invars]
    _note_constant(eqn, consts)
    if not any(ins) and not _holds_jaxpr(eqn):  # (a mark may be inside one: a loop's body)
      continue
    outs = _equation(eqn, ins, flow, consts)
    for var, tangents in zip(eqn.outvars, outs):
      if not _is_float(var):
        continue
      flow.anything.update(k for k, t in tangents.items() if t.kind == "any")
      tangents = {k: t for k, t in tangents.items() if k not in flow.anything}
      if tangents:
        env[var] = tangents


def _start(eqn: Any, name: str, flow: _Flow) -> dict:
  """``{name: the shift}`` at a mark's output: ``c`` constant along the call's positions. Under
  ``vmap`` the jaxpr's output has mapped axes among the call's (``c`` may vary along them),
  usually in front; when their place is ambiguous (equal sizes): "anything"."""
  shape = tuple(eqn.outvars[0].aval.shape)
  own, positions = flow.marks.shapes[name]
  # Where the call's axes are among the jaxpr's: one placement of the mapped axes, or none.
  fits = [kept for kept in itertools.combinations(range(len(shape)), len(own))
          if tuple(shape[i] for i in kept) == own]
  if len(fits) != 1:
    flow.anything.add(name)
    return {}
  constant = {fits[0][p] for p in positions}
  return {name: _Tangent("add", -1 - int(name[len(_PREFIX):]), tuple(
      None if (i in constant or shape[i] == 1) else ("src", i) for i in range(len(shape))))}


def _mark_name(eqn: Any, marks: Marks) -> str:
  """The name of the mark ``eqn`` is (a ``jit`` named by :meth:`Marks.mark`), else ``''``."""
  name = eqn.params.get("name", "") if eqn.primitive.name in ("jit", "pjit") else ""
  return name if isinstance(name, str) and name in marks.paths else ""


def _get(env: dict, var: Any) -> dict:
  return {} if isinstance(var, jax_core.Literal) else env.get(var, {})


def _is_float(var: Any) -> bool:
  """Whether ``var`` holds floating-point values (``bfloat16`` and ``float8`` included)."""
  return hasattr(var.aval, "dtype") and jnp.issubdtype(var.aval.dtype, jnp.inexact)


def _note_constant(eqn: Any, consts: dict) -> None:
  """Records the value of a broadcast, converted or negated scalar constant (a mask's fill
  value: ``-large`` with ``large = jnp.array(1e30)``)."""
  if eqn.primitive.name not in ("broadcast_in_dim", "convert_element_type", "reshape", "neg"):
    return
  v = eqn.invars[0]
  value = (float(v.val) if isinstance(v, jax_core.Literal) and np.ndim(v.val) == 0
           else consts.get(v))
  if value is not None:
    consts[eqn.outvars[0]] = -value if eqn.primitive.name == "neg" else value


def _equation(eqn: Any, ins: list, flow: _Flow, consts: dict) -> list:
  """Each output's ``{mark name: _Tangent}`` of one equation with tangents on its inputs."""
  prim = eqn.primitive.name
  sub = _sub_jaxpr(eqn)
  if prim == "scan":
    return _scan(eqn, ins, flow)
  if prim == "cond":
    return _cond(eqn, ins, flow)
  if _inner_jaxprs(eqn) and (prim not in _ENTERED or sub is None
                             or (prim == "custom_jvp_call" and not _jax_softmax(eqn))):
    # Not entered: a custom derivative is the user's rule, not the primal's (a straight-through
    # estimator); a while loop; a shard_map or pmap body, whose shapes are one device's; other
    # higher-order primitives. Marks inside are "anything".
    flow.anything.update(_marks_in(eqn, flow.marks))
    return [{k: _ANY for k in set().union(*ins)} for _ in eqn.outvars]
  if sub is not None:
    return _call(sub, eqn, ins, flow, consts)
  names = set().union(*ins)
  outs = [dict() for _ in eqn.outvars]
  for name in names:
    tangents = [t.get(name) for t in ins]
    result = _rule(eqn, tangents, consts)
    for out, r in zip(outs, result if isinstance(result, list) else [result] * len(outs)):
      if r is not None:
        out[name] = r
  return outs


def _jax_softmax(eqn: Any) -> bool:
  """Whether a ``custom_jvp_call`` is JAX's own ``softmax`` / ``log_softmax`` (a custom rule
  in some JAX releases), whose rule is the primal's derivative."""
  j = eqn.params.get("call_jaxpr")
  info = str(getattr(getattr(_open(j), "debug_info", None), "func_src_info", "") or "")
  name, _, where = info.partition(" at ")
  return name.lstrip("_") in ("softmax", "log_softmax") and "jax/_src/nn/" in where.replace(
      "\\", "/")


def _inner_jaxprs(eqn: Any) -> list:
  """Every jaxpr among ``eqn``'s parameters (open, closed, or in a tuple: ``cond``'s
  branches)."""
  found = []
  for value in eqn.params.values():
    for v in (value if isinstance(value, (tuple, list)) else (value,)):
      if hasattr(v, "eqns") or hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns"):
        found.append(_open(v))
  return found


def _marks_in(eqn: Any, marks: Marks) -> set:
  """The mark names of the calls inside ``eqn``'s jaxprs, at any depth."""
  names = set()
  for inner in _inner_jaxprs(eqn):
    for e in inner.eqns:
      if _mark_name(e, marks):
        names.add(_mark_name(e, marks))
      names |= _marks_in(e, marks)
  return names


def _holds_jaxpr(eqn: Any) -> bool:
  return bool(_inner_jaxprs(eqn))


def _sub_jaxpr(eqn: Any) -> Any:
  for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
    j = eqn.params.get(key)
    if j is not None and (hasattr(j, "eqns") or hasattr(j, "jaxpr")):
      return j
  return None


def _open(j: Any) -> Any:
  return j.jaxpr if hasattr(j, "jaxpr") and not hasattr(j, "eqns") else j


def _call(sub: Any, eqn: Any, ins: list, flow: _Flow, consts: dict) -> list:
  inner = _open(sub)
  n = len(inner.invars)
  args = ins[len(ins) - n:] if len(ins) >= n else ins + [{}] * (n - len(ins))
  env = {v: t for v, t in zip(inner.invars, args) if t}
  inner_consts = {v: consts[o] for v, o in zip(inner.invars, eqn.invars[len(ins) - n:])
                  if not isinstance(o, jax_core.Literal) and o in consts}
  inner_consts.update({v: float(o.val) for v, o in zip(inner.invars, eqn.invars[len(ins) - n:])
                       if isinstance(o, jax_core.Literal) and np.ndim(o.val) == 0})
  _run(inner, env, flow, inner_consts)
  return [_get(env, v) for v in inner.outvars]


def _scan(eqn: Any, ins: list, flow: _Flow) -> list:
  """A ``scan``: the body run until its carries' tangents stop changing (twice at most after
  the first pass, else the carries are "anything"); ``xs`` lose and ``ys`` gain the leading
  axis (a new ``c`` per iteration)."""
  body = _open(eqn.params["jaxpr"])
  n_consts, n_carry = eqn.params["num_consts"], eqn.params["num_carry"]
  carry = ins[n_consts:n_consts + n_carry]
  xs = [{k: _drop_leading(t) for k, t in x.items()} for x in ins[n_consts + n_carry:]]
  ys = None
  for attempt in range(3):
    env = {v: t for v, t in zip(body.invars, ins[:n_consts] + carry + xs) if t}
    _run(body, env, flow)
    out = [_get(env, v) for v in body.outvars]
    # Every pass's ys: the first iteration's (zero carries) are outputs too.
    ys = out[n_carry:] if ys is None else [_join(a, b) for a, b in zip(ys, out[n_carry:])]
    joined = [_join(a, b) for a, b in zip(carry, out[:n_carry])]
    if joined == carry:
      break
    carry = joined if attempt < 1 else [{k: _ANY for k in c} for c in joined]
  ys = [{k: _ANY if t.kind == "any" else _Tangent(t.kind, next(_fresh), (
      ("ys", 0),) + t.labels) for k, t in y.items()} for y in ys]
  return carry + ys


def _cond(eqn: Any, ins: list, flow: _Flow) -> list:
  outs = None
  for branch in eqn.params["branches"]:
    inner = _open(branch)
    env = {v: t for v, t in zip(inner.invars, ins[1:]) if t}
    _run(inner, env, flow)
    res = [_get(env, v) for v in inner.outvars]
    outs = res if outs is None else [_join(a, b) for a, b in zip(outs, res)]
  return outs


def _drop_leading(t: _Tangent) -> _Tangent:
  """One iteration's slice of ``xs``: the same ``c`` where ``c`` is constant along the scanned
  axis, else a new one (each iteration's differs)."""
  if t.kind == "any":
    return t
  sliced = t._replace(labels=t.labels[1:])
  return sliced if t.labels[0] is None else _fresh_like(sliced)


def _join(a: dict, b: dict) -> dict:
  """Tangents that may be either ``a``'s or ``b``'s (two branches, two iterations): kept where
  they are the same, else "anything" (zero on one side and not on the other included)."""
  out = {}
  for k in set(a) | set(b):
    ta, tb = a.get(k), b.get(k)
    out[k] = ta if ta is not None and tb is not None and ta.same(tb) else _ANY
  return out


def _canonical(t: _Tangent, var: Any, shape: tuple) -> _Tangent:
  """``t`` of an operand broadcast to ``shape`` (size-1 axes: ``c`` is constant along them)."""
  if t.kind == "any":
    return t
  own = () if isinstance(var, jax_core.Literal) else var.aval.shape
  if not own:
    return t._replace(labels=(None,) * len(shape))
  if len(own) != len(shape):
    return _ANY
  return t._replace(labels=tuple(None if own[i] == 1 else l for i, l in enumerate(t.labels)))


def _rule(eqn: Any, ts: list, consts: dict) -> Any:
  """The output tangent(s) of one equation for one mark's input tangents ``ts`` (``None``:
  zero)."""
  prim = eqn.primitive.name
  if any(t is not None and t.kind == "any" for t in ts):
    return None if prim == "stop_gradient" else _ANY
  handler = _RULES.get(prim)
  return handler(eqn, ts, consts) if handler else _ANY


def _identity(eqn, ts, consts):
  del eqn, consts
  return ts[0]


def _zero(eqn, ts, consts):
  del eqn, ts, consts
  return None


def _scalar(var: Any) -> bool:
  return isinstance(var, jax_core.Literal) or not var.aval.shape


def _add_sub(eqn, ts, consts):
  """``x + w``, ``x - w``: ``c`` kept (``w - x``: a new ``c``); ``(x + c) - (x' + c)``: zero;
  a sum of two shifts, a new ``c`` constant where both are."""
  del consts
  shape = eqn.outvars[0].aval.shape
  a, b = (None if t is None else _canonical(t, v, shape) for t, v in zip(ts, eqn.invars))
  if a is None or b is None:
    t = a if b is None else b
    if t.kind != "add":  # y c + w is not (y + w) c
      return _ANY
    return t if a is not None or eqn.primitive.name != "sub" else _fresh_like(t)
  if a.kind != "add" or b.kind != "add":
    return _ANY
  if eqn.primitive.name == "sub" and a.same(b):
    return None
  both = _Tangent("add", -1, tuple(None if x is None and y is None else 0
                                   for x, y in zip(a.labels, b.labels)))
  return _fresh_like(both)


def _mul_div(eqn, ts, consts):
  del consts
  shape = eqn.outvars[0].aval.shape
  a, b = (None if t is None else _canonical(t, v, shape) for t, v in zip(ts, eqn.invars))
  div = eqn.primitive.name == "div"
  if a is not None and b is not None:
    if a.kind == b.kind == "mul":
      if div and a.same(b):
        return None
      return _fresh_like(_Tangent("mul", -1, tuple(
          None if x is None and y is None else 0 for x, y in zip(a.labels, b.labels))))
    return _ANY
  t, other = (a, eqn.invars[1]) if a is not None else (b, eqn.invars[0])
  if t.kind == "mul":  # (y c) w = (y w) c, (y c) / w = (y / w) c; w / (y c): -(w / y) c
    return t if (a is not None or not div) else _fresh_like(t)
  if _scalar(other) and (a is not None or not div):  # c s, c / s: a new c
    return _fresh_like(t)
  return _ANY


def _exp(eqn, ts, consts):
  del eqn, consts
  return ts[0]._replace(kind="mul") if ts[0].kind == "add" else _ANY


def _log(eqn, ts, consts):
  del eqn, consts
  return ts[0]._replace(kind="add") if ts[0].kind == "mul" else _ANY


def _max_min(eqn, ts, consts):
  """``max(-inf, x)`` (``jax.nn.softmax``'s guard) is ``x``, ``max(inf, x)`` a constant (and
  the reverse for ``min``); other maxima are not linear."""
  del consts
  for t, other in ((ts[0], eqn.invars[1]), (ts[1], eqn.invars[0])):
    if t is not None and isinstance(other, jax_core.Literal) and np.isinf(other.val):
      keeps = (other.val < 0) == (eqn.primitive.name == "max")
      return t if keeps else None
  return _ANY


def _reduce(eqn, ts, consts):
  """``max`` / ``sum`` over axes ``c`` is constant along: ``max(x + c) = max(x) + c``,
  ``sum(y c) = sum(y) c``; a ``sum`` of ``c`` is a new ``c`` (scaled)."""
  del consts
  t, axes = ts[0], set(eqn.params["axes"])
  labels = tuple(l for i, l in enumerate(t.labels) if i not in axes)
  const = all(t.labels[i] is None for i in axes)
  prim = eqn.primitive.name
  if prim in ("reduce_max", "reduce_min"):
    return t._replace(labels=labels) if const and t.kind == "add" else _ANY
  if t.kind == "mul":
    return t._replace(labels=labels) if const else _ANY
  return _fresh_like(t._replace(labels=labels))


def _broadcast(eqn, ts, consts):
  del consts
  t = ts[0]
  shape, dims = eqn.params["shape"], eqn.params["broadcast_dimensions"]
  own = eqn.invars[0].aval.shape
  labels = [None] * len(shape)
  for i, d in enumerate(dims):
    labels[d] = None if own[i] == 1 else t.labels[i]
  return t._replace(labels=tuple(labels))


def _reshape(eqn, ts, consts):
  """Axes split or merged: each group of old axes whose sizes multiply to a group of new axes
  keeps ``None`` when all its old axes are ``None``."""
  del consts
  t = ts[0]
  old, new = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
  labels, i, j = [], 0, 0
  while i < len(old) or j < len(new):
    gi, gj = [i], [j]
    po, pn = (old[i] if i < len(old) else 1), (new[j] if j < len(new) else 1)
    i, j = i + 1, j + 1
    while po != pn:
      if po < pn and i < len(old):
        po *= old[i]
        gi.append(i)
        i += 1
      elif pn < po and j < len(new):
        pn *= new[j]
        gj.append(j)
        j += 1
      else:
        return _ANY
    olds = [k for k in gi if k < len(old)]
    labelled = [k for k in olds if t.labels[k] is not None]
    whole = (len(labelled) == 1 and all(old[k] == 1 for k in olds if k != labelled[0])
             and len([k for k in gj if k < len(new) and new[k] > 1]) == 1)
    described = tuple((t.labels[k], old[k]) for k in olds)
    for k in (k for k in gj if k < len(new)):
      if new[k] == 1 or not labelled:
        labels.append(None)
      else:  # one labelled axis kept whole keeps its label; else the group's layout names it
        labels.append(t.labels[labelled[0]] if whole else (described, k - gj[0]))
  return t._replace(labels=tuple(labels))


def _transpose(eqn, ts, consts):
  del consts
  return ts[0]._replace(labels=tuple(ts[0].labels[p] for p in eqn.params["permutation"]))


def _squeeze(eqn, ts, consts):
  del consts
  drop = {d % len(ts[0].labels) for d in eqn.params["dimensions"]}
  return ts[0]._replace(labels=tuple(l for i, l in enumerate(ts[0].labels) if i not in drop))


def _dot_general(eqn, ts, consts):
  """One operand's ``c`` times the other: a new ``c``, constant along the output axes that are
  that operand's free axes ``c`` is constant along."""
  del consts
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  if ts[0] is not None and ts[1] is not None or any(t is not None and t.kind != "add"
                                                   for t in ts):
    return _ANY
  lhs = ts[0] is not None
  nl, nr = (len(v.aval.shape) for v in eqn.invars)
  lfree = [i for i in range(nl) if i not in lc and i not in lb]
  rfree = [i for i in range(nr) if i not in rc and i not in rb]
  t = ts[0] if lhs else ts[1]
  coef = next(_fresh)
  labels = ([(coef, "b", k) for k in range(len(lb))]
            + [None if lhs and t.labels[i] is None else (coef, "l", i) for i in lfree]
            + [None if not lhs and t.labels[i] is None else (coef, "r", i) for i in rfree])
  return _Tangent("add", coef, tuple(labels))


def _select(eqn, ts, consts):
  """``select_n(pred, *cases)``: the cases' common tangent; a case that is a constant fill of at
  most ``_FILL`` (a masked logit) counts as any case's."""
  if ts[0] is not None:
    return _ANY
  cases = list(zip(ts[1:], eqn.invars[1:]))
  live = [t for t, _ in cases if t is not None]
  filled = all(t is not None or (not isinstance(v, jax_core.Literal) and consts.get(v, 0) <= _FILL)
               or (isinstance(v, jax_core.Literal) and float(v.val) <= _FILL) for t, v in cases)
  if not filled or any(not live[0].same(t) for t in live[1:]) or live[0].kind != "add":
    return _ANY
  return live[0]


def _slice(eqn, ts, consts):
  del consts
  return _sliced(ts[0], eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape)


def _sliced(t: _Tangent, old: tuple, new: tuple) -> _Tangent:
  """A slice along axes ``c`` is constant along keeps ``c``; along others, a new ``c``."""
  if len(old) != len(new):
    return _ANY
  cut = [i for i in range(len(old)) if old[i] != new[i]]
  if all(t.labels[i] is None for i in cut):
    return t
  return _fresh_like(t)


def _split(eqn, ts, consts):
  del consts
  return [_sliced(ts[0], eqn.invars[0].aval.shape, o.aval.shape) for o in eqn.outvars]


_RULES = {
    # A cast's derivative is the cast of the tangent (the rounding of a narrowing one, like
    # reduce_precision's, is the rounding every tangent and cotangent of that dtype has).
    **{p: _identity for p in ("convert_element_type", "reduce_precision", "copy", "copy_p",
                              "sharding_constraint", "pvary", "name")},
    "optimization_barrier": lambda eqn, ts, consts: list(ts),
    # Zero tangent. Not floor / round / sign: a straight-through estimator passes cotangents
    # through them (a custom rule around the primitive).
    "stop_gradient": _zero,
    "neg": lambda eqn, ts, consts: ts[0] if ts[0].kind == "mul" else _fresh_like(ts[0]),
    "add": _add_sub, "sub": _add_sub, "add_any": _add_sub,
    "mul": _mul_div, "div": _mul_div,
    "exp": _exp, "log": _log, "max": _max_min, "min": _max_min,
    "reduce_max": _reduce, "reduce_min": _reduce, "reduce_sum": _reduce,
    "broadcast_in_dim": _broadcast, "reshape": _reshape, "transpose": _transpose,
    "squeeze": _squeeze, "dot_general": _dot_general, "select_n": _select,
    "slice": _slice, "dynamic_slice": _slice, "split": _split,
}
