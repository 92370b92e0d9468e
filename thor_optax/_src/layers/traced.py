"""Modules recognised from what their call computes, traced alone on the call's input.

Model libraries write their layers as modules of their own (a dense layer ``x @ self.w``, an
``Einsum`` module, an RMS norm ``x / rms(x) * (1 + scale)``): no Flax class says what such a
module computes, so a kind that takes modules of any class (``matmul.py``,
``channel_affine.py``, ``lookup.py``) traces the module's call alone, on abstract values of its
input, its parameters and its other collections (no FLOPs), and reads the jaxpr. This module
holds what those kinds share: the module's own parameters, which of its methods take an input
(``__call__``, and those of its own class: Gemma's ``Embedder.encode`` and ``decode``), the
trace itself, and the jaxpr primitives that are identities up to the dtype or calls whose body
is read.

Source: this project.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from typing import Any, Callable, Optional

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from thor_optax._src.layers import base

# Identities up to the dtype (a cast to a float of at least 2 bytes: rounding to fp8 or by
# reduce_precision changes the value), and calls whose body is read.
CASTS = frozenset({"convert_element_type", "copy", "copy_p", "name"})
CALLS = frozenset({"pjit", "jit", "closed_call", "core_call", "remat", "remat2", "checkpoint"})
_tracing = threading.local()  # set while a module's call is traced alone (no kind matches)


@contextlib.contextmanager
def _alone():
  """While a module's call is traced by :func:`trace_alone`, no module matches a kind that
  takes modules of any class (the capture's interceptor sees the traced copy's call as a plain
  module's)."""
  _tracing.on = True
  try:
    yield
  finally:
    _tracing.on = False


def tracing_alone() -> bool:
  """Whether a module's call is being traced alone by :func:`trace_alone` in this thread (the NNX
  capture's interceptor then lets the traced copy's calls through)."""
  return getattr(_tracing, "on", False)


def own_params(module: Any) -> dict:
  """The module's own parameters ``{name: array}``, without the capture's channels: a linen
  module's ``params`` collection, unboxed, but leaves named ``'~thor...'``; an NNX module's
  ``nnx.Param`` attributes but those named ``'_thor...'``."""
  if isinstance(module, nnx.Module):
    return {k: v.get_value() for k, v in vars(module).items()
            if isinstance(v, nnx.Param) and not k.startswith("_thor")}
  params = module.variables.get("params", {})
  return {k: nn.meta.unbox(v) for k, v in params.items() if not str(k).startswith("~thor")}


def nested_params(module: nnx.Module) -> bool:
  """Whether an NNX module holds parameters in submodules (or containers) of its own."""
  return any(isinstance(node, nnx.Param) and len(path) > 1
             for path, node in nnx.iter_graph(module))


def _takes_an_input(function: Any) -> bool:
  """Whether ``function`` (a method) takes a positional argument besides ``self``."""
  try:
    params = list(inspect.signature(function).parameters.values())[1:]
  except (TypeError, ValueError):
    return False
  return any(p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                        inspect.Parameter.POSITIONAL_OR_KEYWORD,
                        inspect.Parameter.VAR_POSITIONAL) for p in params)


@functools.lru_cache(maxsize=None)
def takes_an_input(cls: type) -> bool:
  """Whether ``cls`` defines a ``__call__`` that takes a positional argument besides ``self``
  (its input; any others must be Python constants in each call, :func:`base.one_array_input`,
  with which the call is traced)."""
  call = next((c.__dict__["__call__"] for c in cls.__mro__ if "__call__" in c.__dict__), None)
  return _takes_an_input(call)


@functools.lru_cache(maxsize=None)
def layer_methods(cls: type) -> tuple[str, ...]:
  """The methods of ``cls`` through which a kind of any class may take a module's uses:
  ``__call__`` when it takes an input (:func:`takes_an_input`), then the public methods
  (names not starting with ``_``; not ``setup``) that its own classes, not Flax's, define as
  plain functions taking an input (Gemma's embedder: ``encode``, ``decode``; MaxText's
  ``Embed.attend``), in name order."""
  names = {}
  for c in cls.__mro__:
    if c is object or c.__module__.split(".")[0] == "flax":
      continue
    for name, f in c.__dict__.items():
      if (not name.startswith("_") and name != "setup" and inspect.isfunction(f)
          and name not in names):
        names[name] = _takes_an_input(f)
  public = tuple(sorted(n for n, ok in names.items() if ok))
  return (("__call__",) if takes_an_input(cls) else ()) + public


def own_leaves(module: Any) -> Optional[dict]:
  """The own parameters of a module a kind of any class may take (:func:`own_params`): a bound
  linen module or an NNX module with a method taking an input (:func:`layer_methods`);
  ``None`` otherwise (a scope Flax invalidated too). The kinds check the leaves' shapes, then
  NNX submodules' parameters (:func:`nested_params`, last: it walks the graph)."""
  if not layer_methods(type(module)):
    return None
  if not isinstance(module, nnx.Module) and (
      not isinstance(module, nn.Module) or getattr(module, "scope", None) is None):
    return None
  try:
    leaves = own_params(module)
  except Exception:  # pylint: disable=broad-except  # a scope Flax invalidated
    return None
  return leaves if all(hasattr(v, "shape") for v in leaves.values()) else None


def flax_class(module: Any) -> bool:
  """Whether ``module`` is of one of Flax's own classes (their layers are their own kinds', or
  wrap another layer's weight: ``nn.WeightNorm``, ``nn.SpectralNorm``). The class a lifted
  transform makes of a class (``nn.remat(Embedder)``, whose methods other than the lifted
  ``__call__`` run on it as they are) counts as that class."""
  cls = next((c for c in type(module).__mro__ if c.__module__ != "flax.linen.transforms"),
             type(module))
  return cls.__module__.split(".")[0] == "flax"


def _abstract(v: Any) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(jnp.shape(v), jnp.result_type(v))


def _traced_linen(module: nn.Module, names: list, args: tuple, kwargs: dict, method: str
                  ) -> tuple[Any, Any]:
  """``(closed jaxpr, output shape)`` of an unbound copy of a linen module's ``method`` applied
  to the call's arguments, traced from ``(parameters named `names`..., the input x, other
  collections)``, with a key for each random stream of the call."""
  params = own_params(module)
  others = nn.meta.unbox({col: v for col, v in module.variables.items() if col != "params"})
  streams = sorted(getattr(module.scope, "rngs", None) or {})
  copy = module.clone(parent=None)

  def call(leaves, x, others):
    rngs = {name: jax.random.key(0) for name in streams}
    xargs, xkwargs = base.with_input(args, kwargs, x)
    return copy.apply({"params": dict(zip(names, leaves)), **others}, *xargs, rngs=rngs,
                      method=method, **xkwargs)

  return jax.make_jaxpr(call, return_shape=True)(
      [_abstract(params[k]) for k in names], _abstract(base.primary_input(args, kwargs)),
      jax.tree.map(_abstract, others))


def _traced_nnx(module: nnx.Module, names: list, args: tuple, kwargs: dict, method: str
                ) -> tuple[Any, Any]:
  """``(closed jaxpr, output shape)`` of a copy of an NNX module's ``method`` called with the
  call's arguments, traced from ``(parameters named `names`..., the input x, the module's other
  state)``."""
  graphdef, state = nnx.split(module)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
  keys = [tuple(str(k.key) for k in path if hasattr(k, "key")) for path, _ in leaves]
  own = [keys.index((k,)) for k in names]
  rest = [i for i in range(len(leaves)) if i not in own]

  def call(params, x, others):
    values = [None] * len(leaves)
    for i, v in zip(own + rest, list(params) + list(others)):
      values[i] = v
    xargs, xkwargs = base.with_input(args, kwargs, x)
    copy = nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, values))
    return getattr(copy, method)(*xargs, **xkwargs)

  return jax.make_jaxpr(call, return_shape=True)(
      [_abstract(leaves[i][1]) for i in own], _abstract(base.primary_input(args, kwargs)),
      [_abstract(leaves[i][1]) for i in rest])


def trace_alone(module: Any, names: list, args: tuple, kwargs: dict,
                method: str = "__call__") -> tuple[Any, Any]:
  """``(closed jaxpr, output shape)`` of ``module``'s call of ``method`` (default: ``__call__``)
  with arguments ``args``, ``kwargs``
  (one array, :func:`base.primary_input`, and Python constants), traced alone from
  ``(its parameters named `names`..., the input, its other collections or state)``, while no
  module matches a kind of any class (:func:`tracing_alone`).

  Raises:
    Exception: whatever the module's call raises when traced so (the kinds list the module
      with it).
  """
  with _alone():
    return (_traced_nnx if isinstance(module, nnx.Module) else _traced_linen)(
        module, names, args, kwargs, method)


def trace_or_reason(module: Any, names: list, args: tuple, kwargs: dict,
                    method: str = "__call__") -> tuple[Any, Any, str]:
  """``(closed jaxpr, output shape, '')`` of :func:`trace_alone`, or ``(None, None, why)`` when
  the call cannot be traced so (any exception: the kinds list the module with ``why``)."""
  try:
    closed, shape = trace_alone(module, names, args, kwargs, method)
  except Exception as e:  # pylint: disable=broad-except  # any failure lists the module
    return None, None, (f"its call could not be traced alone on its input ({type(e).__name__}: "
                        f"{str(e)[:120]})")
  return closed, shape, ""


def float_cast(eqn: Any) -> bool:
  """Whether ``eqn`` is one of :data:`CASTS` to a float of at least 2 bytes: an identity up to
  the dtype (a cast to fp8 rounds the value)."""
  dtype = eqn.outvars[0].aval.dtype if eqn.outvars else None
  return (eqn.primitive.name in CASTS and dtype is not None
          and jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize >= 2)


def is_call(eqn: Any) -> bool:
  """Whether ``eqn`` calls a body the kinds' walks read (``jit``, ``remat``, ...)."""
  return eqn.primitive.name in CALLS and "jaxpr" in eqn.params


def walk_call(eqn: Any, tags_in: list, tags: dict, walk: Callable[[Any, dict], str]) -> str:
  """Walks the body of a call equation (:func:`is_call`) with ``walk(body, body_tags)``, the
  body's inputs tagged as the call's (``tags_in``, ``None`` untagged), then tags the call's
  outputs as the body's; returns ``walk``'s reason (``''``: none)."""
  inner = eqn.params["jaxpr"]
  inner = getattr(inner, "jaxpr", inner)
  sub = {v: t for v, t in zip(inner.invars, tags_in) if t}
  why = walk(inner, sub)
  if not why:
    for v, w in zip(eqn.outvars, inner.outvars):
      if isinstance(w, jax.extend.core.Var) and w in sub:
        tags[v] = sub[w]
  return why


def scalar_literal(v: Any) -> Optional[float]:
  """The value of an operand that is a scalar literal of the jaxpr, else ``None``."""
  if isinstance(v, jax.extend.core.Literal) and np.ndim(v.val) == 0:
    return float(v.val)
  return None
