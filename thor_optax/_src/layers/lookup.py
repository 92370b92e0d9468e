"""Embedding tables of modules of any class whose call looks rows up by integer ids.

MaxText's, T5X's and flaxformer's ``Embed`` modules hold their table as a parameter of their own
and look tokens up in ``__call__``, ``jnp.asarray(self.embedding, self.dtype)[inputs]``;
tutorials write ``self.param('wte', ...)[tokens]`` or ``jnp.take(table, ids, axis=0)``, some
scaled by a constant (``* sqrt(d)``). No Flax class says what such a module computes, so this
kind recognises it from its call, traced alone (``traced.py``): a linen or NNX module whose own
parameter is one table ``(vocab, features)`` and whose call on integer ids is, up to float
casts, ``c * table[ids]`` (one ``gather`` of whole rows by the ids themselves, ``c`` a constant
computed from literals alone) is an embedding: its curvature is the ``'embed'`` kind's
(``embed.py``: THOR's diagonal ``A`` of token counts, ``G`` from the output cotangents), with the
constant folded into the cotangents (``d table = c scatter(g)``). Anything else (a mask or
another array multiplying the rows, rows looked up by a function of the ids such as ``ids + 2``,
whose token counts would be the wrong rows', rows of another axis; a one-hot product is the
``'matmul'`` kind's dense layer) lists the module with the reason.

A table named ``embedding`` gives :class:`~thor_optax._src.layers.embed.EmbedStats`, which the
``'embed'`` kind lays out from its shape; any other :class:`LookupStats`, naming it, laid out
from the capture's statistics (``layers=captured_layers(stats)``).

Tied output embeddings: MaxText's ``Embed.attend`` and Gemma's ``Embedder.decode`` apply the
same table to the last hidden states, ``logits = h @ table.T`` (Gemma's embedder has no
``__call__``: ``encode`` looks up). Every method of the module's own class that takes an input
is intercepted and traced alone; one on floats that is ``c * h @ table.T`` (up to float casts,
the product contracting ``h``'s last axis with the table's features) is a tied use, joined with
the lookups as ``nn.Embed``'s ``attend`` is (``embed.py``, Eschenhagen et al. 2023), the
constant folded into the logit cotangents. A method that reads the table otherwise (a soft cap
``tanh`` of the logits, a norm of ``h`` inside ``decode``) lists the module with the reason.

References:
  Chen et al., "THOR", AAAI 2021 (diagonal ``A`` of embeddings).
  Eschenhagen et al., "Kronecker-Factored Approximate Curvature for Modern Neural Network
  Architectures", NeurIPS 2023 (a shared weight's uses).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from thor_optax._src.layers import base
from thor_optax._src.layers import embed
from thor_optax._src.layers import traced


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LookupStats:
  """:class:`~thor_optax._src.layers.embed.EmbedStats`' fields for a table of a module of one's
  own not named ``embedding``.

  Attributes:
    inputs: integer token ids ``(N, ...)``: the rows the lookup read (:func:`rows_read`;
      ``vocab`` for an id it read none for).
    cotangents: per-example cotangents of the looked-up rows ``(S, N, ..., features)`` (the
      output's, times the call's constant).
    attend_inputs: the inputs ``h`` ``(N, P, features)`` of the tied output uses (``decode``,
      ``attend``), or ``None``; as ``EmbedStats``', so that the ``'embed'`` kind's maths
      reads these statistics as its own.
    attend_cotangents: their logit cotangents times their constant, ``(S, N, P, vocab)``, or
      ``None``.
    num_terms: as ``EmbedStats``' (static).
    table: the table leaf's name (static).

  Source: Chen et al., THOR, AAAI 2021; a type apart from ``EmbedStats`` so that the table is
  read by name (this project).
  """

  inputs: jax.Array
  cotangents: jax.Array
  attend_inputs: Optional[jax.Array] = None
  attend_cotangents: Optional[jax.Array] = None
  num_terms: Optional[int] = dataclasses.field(default=None, metadata=dict(static=True))
  table: str = dataclasses.field(default="embedding", metadata=dict(static=True))


class Use(NamedTuple):
  """How one call reads the table (static, in the plan's ``uses``).

  Attributes:
    role: ``'lookup'`` (``c * table[ids]``) or ``'attend'`` (the tied output ``c * h @
      table.T``).
    scale: the constant ``c``.
    wrapped: a lookup's negative ids wrapped (:func:`rows_read`; ``False`` for attend).
    mode: a lookup's out-of-range ids ``'clip'`` or ``'drop'`` (``''`` for attend).

  Source: this project.
  """

  role: str
  scale: float
  wrapped: bool
  mode: str


def own_table(module: Any) -> Optional[str]:
  """The name of the own parameter of a module a kind of any class may take
  (:func:`traced.own_leaves`), of no Flax class (:func:`traced.flax_class`), when it is its
  only one, of rank 2, and no submodule holds parameters; ``None`` otherwise."""
  leaves = None if traced.flax_class(module) else traced.own_leaves(module)
  if leaves is None or len(leaves) != 1 or next(iter(leaves.values())).ndim != 2:
    return None
  if isinstance(module, nnx.Module) and traced.nested_params(module):  # last: it walks the graph
    return None
  return next(iter(leaves))


def _constant(jaxpr: Any, var: Any) -> Optional[float]:
  """The value of a scalar ``var`` of ``jaxpr`` that is a literal or computed from literals alone
  (``jnp.sqrt(d)``), else ``None``."""
  if not isinstance(var, jax.extend.core.Var):
    return traced.scalar_literal(var)
  values: dict = {}
  with jax.ensure_compile_time_eval():  # concrete values, also inside the capture's trace
    _evaluate(jaxpr, values)
  value = values.get(var)
  return None if value is None or np.ndim(value) else float(value)


def _evaluate(jaxpr: Any, values: dict) -> None:
  """Fills ``values`` with the value of every variable of ``jaxpr`` computed from literals
  alone (equations of calls are left out)."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in traced.CALLS or any(
        isinstance(v, jax.extend.core.Var) and v not in values for v in eqn.invars):
      continue
    args = [v.val if isinstance(v, jax.extend.core.Literal) else values[v] for v in eqn.invars]
    outs = eqn.primitive.bind(*args, **eqn.params)
    for v, o in zip(eqn.outvars, outs if eqn.primitive.multiple_results else [outs]):
      values[v] = o


def _is_row_gather(eqn: Any, ids_shape: tuple) -> bool:
  """Whether a ``gather`` takes whole rows of its rank-2 operand, one per id, in the ids'
  layout (output ``ids.shape + (features,)``): ``table[ids]``, ``jnp.take(table, ids,
  axis=0)``."""
  dims = eqn.params["dimension_numbers"]
  operand = eqn.invars[0].aval.shape
  return (tuple(dims.collapsed_slice_dims) == (0,) and tuple(dims.start_index_map) == (0,)
          and not tuple(dims.operand_batching_dims)
          and tuple(eqn.params["slice_sizes"]) == (1, operand[1])
          and tuple(dims.offset_dims) == (len(ids_shape),)
          and tuple(eqn.outvars[0].aval.shape) == tuple(ids_shape) + (operand[1],))


def _value_preserving(before: Any, after: Any, vocab: int) -> bool:
  """Whether an integer cast ``before -> after`` keeps every value of ``before`` in ``[-vocab,
  vocab]``, those of ids in range or wrapped (indexing's ``int64 -> int32``; not ``-> uint8``
  for a table of 300 rows, nor a sign lost)."""
  a, b = jnp.iinfo(before), jnp.iinfo(after)
  return b.min <= max(a.min, -vocab) and b.max >= min(a.max, vocab)


def _ids_step(eqn: Any, kinds: list, vocab: int) -> Optional[str]:
  """The tag of an equation's output on the ids: ``'ids'``, the ids themselves up to casts that
  keep their values and axes of size 1; ``'ids~'``, them with negative ids wrapped,
  ``select_n(ids < 0, ids, ids + vocab)`` as indexing does (``'neg'``, ``'wrapped'``: its two
  parts); ``None`` for any other function of them."""
  prim, ins, out = eqn.primitive.name, eqn.invars, eqn.outvars[0]
  literal = [traced.scalar_literal(v) for v in ins]
  if prim in traced.CASTS and kinds[0] in ("ids", "ids~") and len(kinds) == 1 and \
      jnp.issubdtype(out.aval.dtype, jnp.integer) and _value_preserving(
          ins[0].aval.dtype, out.aval.dtype, vocab):
    return kinds[0]
  if prim in ("broadcast_in_dim", "reshape") and kinds[0] in ("ids", "ids~") and len(
      kinds) == 1 and [n for n in ins[0].aval.shape if n != 1] == [
          n for n in out.aval.shape if n != 1]:
    return kinds[0]
  if prim == "lt" and kinds == ["ids", None] and literal[1] == 0:
    return "neg"
  if prim == "add" and sorted(map(str, kinds)) == ["None", "ids"] and vocab in literal:
    return "wrapped"
  if prim == "select_n" and kinds == ["neg", "ids", "wrapped"]:
    return "ids~"
  return None


_MODES = {"PROMISE_IN_BOUNDS": "clip", "CLIP": "clip", "FILL_OR_DROP": "drop"}


def _walked(jaxpr: Any, tags: dict, step: Callable[[Any, Any, list, dict], str]) -> str:
  """Runs ``step(jaxpr, eqn, tags of its operands, tags)`` on every equation of ``jaxpr`` that
  reads a tagged value (``tags``: ``{var: tag}``, filled by ``step``), the bodies of calls
  (``jnp.take``'s ``jit``) walked the same way; returns the first reason ``step`` gives for an
  operation it does not take (``''``: none)."""
  for eqn in jaxpr.eqns:
    kinds = [tags.get(v) if isinstance(v, jax.extend.core.Var) else None for v in eqn.invars]
    if not any(kinds):
      continue
    if traced.is_call(eqn):
      why = traced.walk_call(eqn, kinds, tags, lambda body, sub: _walked(body, sub, step))
    else:
      why = step(jaxpr, eqn, kinds, tags)
    if why:
      return why
  return ""


def _scaled(jaxpr: Any, eqn: Any, kinds: list, tags: dict, what: str) -> Optional[str]:
  """For ``mul`` / ``div`` of one tagged tuple ``(role, c, ...)`` (``what``: its name in the
  reason) by a constant (:func:`_constant`): tags the output ``(role, c * k or c / k, ...)``
  and returns ``''``; the reason for another array; ``None`` when ``eqn`` is no such
  product. Also a ``neg`` of it (``k = -1``) and an array that depends on neither the table nor
  the input added to it or subtracted (a constant bias of the logits: the tuple's cotangent is
  the output's, its sign flipped for ``other - tuple``), of the tuple's shape."""
  tuples = [k for k in kinds if isinstance(k, tuple)]
  prim = eqn.primitive.name
  if prim == "neg" and tuples:
    tags[eqn.outvars[0]] = (tuples[0][0], -tuples[0][1]) + tuples[0][2:]
    return ""
  if (prim in ("add", "sub") and len(tuples) == 1 and None in kinds and len(kinds) == 2
      and eqn.outvars[0].aval.shape == eqn.invars[kinds.index(tuples[0])].aval.shape):
    flip = prim == "sub" and kinds[1] == tuples[0]
    tags[eqn.outvars[0]] = (tuples[0][0], -tuples[0][1] if flip else tuples[0][1]) + tuples[0][2:]
    return ""
  if not (prim in ("mul", "div") and len(tuples) == 1 and len(kinds) == 2
          and (prim == "mul" or kinds[0] == tuples[0])):
    return None
  i = 1 - kinds.index(tuples[0])
  c = None if kinds[i] is not None else _constant(jaxpr, eqn.invars[i])
  if c is None:
    return f"it multiplies the {what} by an array that is not a constant ({prim})"
  tag = tuples[0]
  tags[eqn.outvars[0]] = (tag[0], tag[1] * c if prim == "mul" else tag[1] / c) + tag[2:]
  return ""


def _lookup_step(ids_shape: tuple, vocab: int) -> Callable[[Any, Any, list, dict], str]:
  """The :func:`_walked` step of a lookup: tags the values derived from the table
  (``'table'``: itself, up to casts; ``('rows', c, wrapped, mode)``: its rows looked up by the
  ids, times the constant ``c``, the ids' negative ones ``wrapped`` or not, those out of range
  clipped or dropped, ``mode``) and from the ids (:func:`_ids_step`)."""

  def step(jaxpr, eqn, kinds, tags):
    prim, out = eqn.primitive.name, eqn.outvars
    if "table" not in kinds and not any(isinstance(k, tuple) for k in kinds):
      other = next((k for k in kinds if str(k).startswith("f(ids)")), f"f(ids) {prim}")
      for v in out:  # another function of the ids (a mask, shifted ids), named by its first op
        tags[v] = _ids_step(eqn, kinds, vocab) or other
    elif traced.float_cast(eqn):
      tags[out[0]] = kinds[0]
    elif prim == "gather" and kinds[0] == "table" and kinds[1] in ("ids", "ids~") \
        and _is_row_gather(eqn, ids_shape) and eqn.params["mode"].name in _MODES:
      tags[out[0]] = ("rows", 1.0, kinds[1] == "ids~", _MODES[eqn.params["mode"].name])
    elif prim == "gather" and kinds[0] == "table" and str(kinds[1]).startswith("f(ids)"):
      return f"it looks rows up by a function of the ids ({kinds[1][7:]})"
    else:
      why = _scaled(jaxpr, eqn, kinds, tags, "rows")
      if why is None:
        named = sorted({k if k == "table" else "rows" if isinstance(k, tuple) else "ids"
                        for k in kinds if k})
        why = f"it applies {prim} to the {' and '.join(named)}"
      return why
    return ""

  return step


def _reads(jaxpr: Any, var: Any) -> bool:
  """Whether ``jaxpr`` reads its input ``var`` (an equation's operand or an output)."""
  return any(v is var for eqn in jaxpr.eqns for v in eqn.invars) or any(
      v is var for v in jaxpr.outvars)


def layout(module: Any, args: tuple, kwargs: dict, method: str = "__call__"
           ) -> tuple[Optional[dict], str]:
  """``(meta, '')`` when the call of ``module``'s ``method`` (a module :func:`own_table`
  matches) on integer ids is ``c * table[ids]``, or on floats ``h`` the tied output ``c * h @
  table.T`` (module docstring), else ``(None, reason)``; ``(None, '')`` when it does not read
  the table (no use of it). ``meta``: ``table`` (the leaf's name), ``vocab``, and ``uses``:
  one :data:`Use` ``(role, c, wrapped, mode)``, role ``'lookup'`` (with how ids map to rows:
  ``wrapped``, ``mode``, :func:`rows_read`) or ``'attend'``."""
  name = own_table(module)
  x = base.primary_input(args, kwargs)
  what = f"{type(module).__name__} holds a table {name!r}"
  closed, shape, why = traced.trace_or_reason(module, [name], args, kwargs, method)
  if why:
    return None, f"{what} but {why}; register a layer kind for it (thor_optax.register_layer_kind)"
  jaxpr = closed.jaxpr
  if method != "__call__" and not _reads(jaxpr, jaxpr.invars[0]):
    return None, ""
  vocab = jaxpr.invars[0].aval.shape[0]
  ids = jnp.issubdtype(jnp.result_type(x), jnp.integer)
  tags = {jaxpr.invars[0]: "table", jaxpr.invars[1]: "ids" if ids else "x"}
  try:
    step = (_lookup_step if ids else _attend_step)(jnp.shape(x), vocab)
    why = _walked(jaxpr, tags, step)
  except Exception as e:  # pylint: disable=broad-except  # an unforeseen form lists the module
    why = f"its jaxpr could not be read ({type(e).__name__}: {str(e)[:120]})"
  out = tags.get(jaxpr.outvars[0]) if isinstance(jaxpr.outvars[0], jax.extend.core.Var) \
      else None
  if not why and (not isinstance(shape, jax.ShapeDtypeStruct) or not isinstance(out, tuple)):
    why = ("its output is not one array of rows of the table" if ids else
           "its output is not one array of the input times the table transposed")
  if why:
    call = f"{method}" if method != "__call__" else "call"
    return None, (f"{what}, but its {call} is not "
                  + ("a lookup of rows of it by the ids" if ids else "the tied output "
                     "h @ table.T of its input") + f": {why}; register a layer kind for it "
                  "(thor_optax.register_layer_kind)")
  role, scale, wrapped, mode = out
  use = Use("lookup" if role == "rows" else "attend", scale, wrapped, mode)
  return dict(table=name, vocab=vocab, uses=(use,)), ""


def _attend_step(x_shape: tuple, vocab: int) -> Callable[[Any, Any, list, dict], str]:
  """The :func:`_walked` step of a tied output: tags the values derived from the table
  (``'table'``, ``'table.T'``: itself or transposed, up to casts) and from the input ``h``
  (``'x'``, up to casts), and the tied output ``('attend', c, False, '')``: ``c`` times the
  product of ``h`` (first operand) and the table, contracting ``h``'s last axis with the
  table's features (``jnp.dot(h, table.T)``, ``jnp.einsum('...d,vd->...v', h, table)``),
  output ``h.shape[:-1] + (vocab,)``."""

  def step(jaxpr, eqn, kinds, tags):
    prim, out = eqn.primitive.name, eqn.outvars
    if traced.float_cast(eqn):
      tags[out[0]] = kinds[0]
    elif prim == "transpose" and kinds == ["table"] and tuple(eqn.params["permutation"]) == (1, 0):
      tags[out[0]] = "table.T"
    elif prim == "dot_general" and kinds in (["x", "table"], ["x", "table.T"]):
      (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
      features = 1 if kinds[1] == "table" else 0
      if (tuple(lc) != (len(x_shape) - 1,) or tuple(rc) != (features,) or tuple(lb)
          or tuple(rb) or tuple(out[0].aval.shape) != tuple(x_shape[:-1]) + (vocab,)):
        return "it multiplies the input and the table along other axes"
      tags[out[0]] = ("attend", 1.0, False, "")
    else:
      why = _scaled(jaxpr, eqn, kinds, tags, "product")
      if why is None:
        named = sorted({"input" if k == "x" else "product" if isinstance(k, tuple) else "table"
                        for k in kinds if k})
        why = f"it applies {prim} to the {' and '.join(named)}"
      return why
    return ""

  return step


def _named(stats: embed.EmbedStats, table: str) -> Any:
  """``stats`` for a table named ``embedding``, else as :class:`LookupStats` naming it."""
  if table == "embedding":
    return stats
  return LookupStats(stats.inputs, stats.cotangents, stats.attend_inputs,
                     stats.attend_cotangents, table=table)


def rows_read(ids: jax.Array, wrapped: bool, mode: str, vocab: int) -> jax.Array:
  """The rows a lookup reads for ``ids``: negative ids wrapped (``ids + vocab``) when the call
  wraps them, then those out of ``[0, vocab)`` clipped (``mode='clip'``: XLA's gather clamps)
  or set to ``vocab`` (``'drop'``: a filling gather reads none, and ``A`` counts none)."""
  rows = jnp.where(ids < 0, ids + vocab, ids) if wrapped else ids
  if mode == "clip":
    return jnp.clip(rows, 0, vocab - 1)
  return jnp.where((rows < 0) | (rows >= vocab), vocab, rows)


class Lookup(embed.Embed):
  """The ``'lookup'`` kind: a linen or NNX module of any class but Flax's whose own parameter is
  one table ``(vocab, features)`` (:func:`own_table`) and whose calls on integer ids are ``c *
  table[ids]``, and on floats ``h``, if any, the tied output ``c * h @ table.T``
  (:func:`layout`): the ``Embed`` of MaxText, T5X and flaxformer (``__call__`` and
  ``attend``), Gemma's ``Embedder`` (``encode`` and ``decode``), a hand-written
  ``self.param('wte', ...)[tokens]``. A module holding one array of rank 2 is tried as a
  ``'matmul'`` and a ``'channel_affine'`` layer first; this kind plans its calls when those
  list them. Every method of the module's own class that takes an input is intercepted
  (``traced.layer_methods``); a call that does not read the table is no use of it.

  The curvature is the ``'embed'`` kind's (diagonal ``A`` of token counts, ``G`` from the
  cotangents, folded with ``c``); the uses of a table looked up and applied as the tied output
  are joined as ``nn.Embed``'s ``__call__`` and ``attend`` are (weight sharing, Eschenhagen et
  al. 2023). A table named ``embedding`` gives
  :class:`~thor_optax._src.layers.embed.EmbedStats`, laid out by the ``'embed'`` kind from its
  shape; any other :class:`LookupStats`, laid out from the capture's statistics
  (``layers=thor_optax.captured_layers(stats)``).

  Listed in ``CurvatureStats.unhandled`` instead of captured: a call that reads the table
  otherwise (the reason names the first other operation: a mask times the rows, a soft cap
  ``tanh`` of the logits), a ``__call__`` whose input is not integer ids, and as for
  ``'embed'``, scalar ids and uses inside a lifted transform.

  Raises:
    ValueError: at a check step, naming the layer, for statistics that are not
      :class:`LookupStats` of ids and cotangents that fit the table.

  Source: Chen et al., THOR, AAAI 2021 (diagonal ``A``); Eschenhagen et al., NeurIPS 2023
  (tied uses); this project (recognising the lookup and the tied output from the traced call).
  """

  name = "lookup"
  stats_type = LookupStats
  linen_modules = ()
  nnx_modules = ()
  methods = ("__call__",)
  live_plan = True
  shares_weights = True
  stacks_from_shapes = False

  def matches(self, module: Any) -> bool:
    """A bound linen module or an NNX module whose own parameter is one rank-2 table
    (:func:`own_table`); whether its calls are lookups is the plan's question."""
    return not traced.tracing_alone() and own_table(module) is not None

  def intercepts(self, module: Any, method: str) -> bool:
    return method in traced.layer_methods(type(module))

  def plan_call(self, module, args, kwargs) -> base.Plan:
    return self.plan_method(module, "__call__", args, kwargs)

  def plan_method(self, module, method, args, kwargs) -> Optional[base.Plan]:
    """A call of any method (:meth:`intercepts`) on an array with a batch axis, its other
    arguments Python constants: a lookup on integer ids, the tied output on floats
    (:func:`layout`); ``None`` for a method other than ``__call__`` that does not read the
    table. A ``__call__`` on floats is listed (a product is the ``'matmul'`` kind's)."""
    x = base.primary_input(args, kwargs)
    ids = isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.integer)
    if method == "__call__" and not ids:
      return base.Plan(None, f"{type(module).__name__} holds a table, but its input is not "
                       "an array of integer ids")
    plan = self.plan(module, (method,), jnp.shape(x))
    if plan.meta is None:
      return plan
    meta, why = layout(module, args, kwargs, method)
    return None if meta is None and not why else base.Plan(meta, why)

  def transposed_use(self, leaf, shape):
    """The tied output ``h @ table.T`` of a ``Dense`` given the table transposed: an
    ``'attend'`` :data:`Use`."""
    if len(shape) != 2:
      return None
    return "attend", base.Plan(dict(table=leaf, vocab=shape[0],
                                    uses=(Use("attend", 1.0, False, ""),)))

  def join_plans(self, plans: list) -> base.Plan:
    """One plan for all the calls when they agree; calls that read the table differently (a
    lookup and its tied output, lookups scaled differently) joined, their :data:`Use` s one
    per call in call order (``make_shared_stats``)."""
    refused = next((p for p in plans if p.meta is None), None)
    if refused is not None or not plans or all(p == plans[0] for p in plans):
      return super().join_plans(plans)
    return base.Plan(dict(plans[0].meta, uses=tuple(u for p in plans for u in p.meta["uses"])))

  def make_stats(self, inputs, cotangents, *, table, vocab, uses) -> Any:
    """The rows read (:func:`rows_read` of the ids, so that ``A`` counts them) and the
    cotangents times ``c`` of the one lookup: ``EmbedStats`` for a table named ``embedding``,
    else :class:`LookupStats` naming it."""
    (_, scale, wrapped, mode), = uses
    return _named(embed.EmbedStats(rows_read(inputs, wrapped, mode, vocab),
                                   cotangents * jnp.asarray(scale, cotangents.dtype)), table)

  def make_shared_stats(self, methods, inputs, cotangents, *, table, vocab, uses) -> Any:
    """Every use as ``nn.Embed``'s: a lookup's rows read and cotangents times ``c``, a tied
    output's input ``h`` and logit cotangents times ``c`` (``uses``: one :data:`Use` per call,
    or one for all)."""
    del methods
    uses = uses * len(inputs) if len(uses) == 1 else uses
    roles, xs, gs = [], [], []
    for (role, scale, wrapped, mode), x, g in zip(uses, inputs, cotangents, strict=True):
      roles.append("__call__" if role == "lookup" else "attend")
      xs.append(rows_read(x, wrapped, mode, vocab) if role == "lookup" else x)
      gs.append(g * jnp.asarray(scale, g.dtype))
    return _named(super().make_shared_stats(tuple(roles), xs, gs), table)

  def per_loss_term(self, stats, num_terms, weight_sharing):
    """``'embed'``'s, keeping the statistics' type and table name."""
    folded = super().per_loss_term(stats, num_terms, weight_sharing)
    if not isinstance(stats, LookupStats):
      return folded
    return LookupStats(folded.inputs, folded.cotangents, folded.attend_inputs,
                       folded.attend_cotangents, num_terms=folded.num_terms, table=stats.table)

  def claim(self, path, shapes) -> Optional[base.Claim]:
    """Never from shapes alone (a rank-2 leaf of another name is no table by its shape)."""
    del path, shapes
    return None

  def claim_captured(self, path, shapes, hint) -> Optional[base.Claim]:
    del path
    table = shapes.get(hint[0])
    if table is None or len(table) != 2 or set(shapes) != {hint[0]}:
      return None
    return base.Claim(a_dim=None, g_dim=table[1])

  def hint(self, stats: LookupStats) -> tuple:
    return (stats.table,)

  def leaf_names(self, hint: tuple) -> tuple[str, Optional[str]]:
    return (hint[0] if hint else self.weight), None

  def to_matrix(self, spec, leaves, dtype) -> jax.Array:
    return leaves[self.leaf_names(spec.hint)[0]].astype(dtype)

  def from_matrix(self, spec, matrix, leaves) -> dict[str, jax.Array]:
    name = self.leaf_names(spec.hint)[0]
    return {name: matrix.reshape(leaves[name].shape).astype(leaves[name].dtype)}
