"""Capture of curvature statistics from an unchanged Flax NNX model.

``value_and_grad_with_stats(loss_fn)(model, x, y)`` is the NNX counterpart of the linen capture
(:mod:`thor_optax._src.capture`): one forward and one backward pass give the loss, the gradients
(as ``nnx.grad`` gives them) and the statistics of every captured layer, by the same zero
output perturbations and the same planning, Fisher types and per-kind statistics.

Why class-level patching. Linen routes every module method through
``flax.linen.intercept_methods``; NNX has no such hook. ``nnx.capture``/``sow``/``perturb`` work
only where the model itself calls them, i.e. they need a model edit. So while the capture runs
its forward passes, the intercepted methods of every registered layer kind's NNX classes
(``layers/``: ``__call__`` of ``nnx.Linear``, ``nnx.LinearGeneral``, ``nnx.Einsum``, ``nnx.Conv``,
``nnx.Embed``, ``nnx.BatchNorm``, ``nnx.LayerNorm``, ``nnx.GroupNorm`` and ``nnx.RMSNorm``, and
``nnx.Embed.attend``, a tied embedding's second use), and those of the model's modules that a kind
of any class takes (``__call__`` and their own public methods taking an input,
``traced.layer_methods``: Gemma's ``Embedder.encode`` and ``decode``) are replaced on the class
by a wrapper, inside a context manager that restores the originals in ``finally``. User models are
never edited. The wrappers act only on the thread that entered the context and only on the modules
of the model copy being captured (found by object identity); every other call, in this or another
thread, goes to the original method. Nested captures are reference-counted, so the classes are
restored when the outermost one exits.

How the model is run. The model is split into its ``nnx.Param`` state and the rest
(``BatchStat``, RNG keys and counts, other variables); the forward pass merges a fresh copy
(``nnx.merge(..., copy=True)``) inside ``jax.vjp`` and calls it once, with patched layers that
record their input and add a zero perturbation to their output. The copy's non-``Param`` state
after the call (updated running averages, advanced RNG counts) is written back to the model
with ``nnx.update``, so the model ends exactly as after a plain ``model(x)`` call; this works
under ``nnx.jit``. Before that, an abstract pass (``jax.eval_shape``, no FLOPs) on another copy
finds the calls, their shapes and the layers that cannot be captured.

``x_hat`` of a normalization layer (the normalized input before scale and bias) comes from a
clone of the layer taken before its call (the kind's ``unit_affine``, ``nnx.clone``: the
running statistics as the layer sees them), with its scale set to ones and its bias (where it
has one: not ``nnx.RMSNorm``) to zeros, applied to the same arguments:
``x_hat * 1 + 0`` is exact, is never formed as ``(y - bias) / scale`` (zero scale is legal), and
has the layer's output dtype. The clone's own running-average update is discarded.

Limitations:

* only the classes above are intercepted, and only their own ``__call__`` (a subclass that
  overrides ``__call__`` without calling ``super().__call__`` is not captured; it is listed
  as unhandled); a call of a patched method inside another call of the same module is part of
  that call (``__call__`` calling ``self.encode``: one use);
* layers run inside NNX lifted transforms (``nnx.scan``, ``nnx.vmap``, ``nnx.remat``, ...) are
  copies the transform makes: the capture tags every layer of the model copy with its path (a
  static attribute, kept in the graph definition the transform splits and merges) and gives it
  ``nnx.Param``-typed channel variables (its zero perturbation, its input record), which the
  transform slices, stacks and returns like the layer's parameters. So a stack of layers
  (made by ``nnx.vmap``, run by ``nnx.scan``: parameters with a leading layer axis) gets
  Kronecker factors per layer, and ``nnx.remat`` layers are captured as if called directly. A
  layer whose one set of weights is applied at every iteration (a cell carried through
  ``nnx.scan`` by ``nnx.RNN`` or broadcast into it; a layer broadcast into ``nnx.vmap``) is
  weight sharing over the iterations, captured with K-FAC-reduce (``step_sharing.py``); a
  layer used several times directly in the forward pass (called twice, a tied embedding's
  ``__call__`` and ``attend``) is captured with all its uses (weight sharing,
  ``capture.shared_uses``);
* calling a layer inside a raw ``jax`` transform of a closure (``jax.checkpoint``,
  ``jax.lax.scan``) within the model is not supported (use the ``nnx`` transforms).

References:
  kfac-jax ``tracer.py``: zero perturbations of layer outputs give output cotangents in one vjp.
  Flax NNX ``nnx.split`` / ``nnx.merge`` / ``nnx.update``: the functional API ``nnx.grad`` is
  built on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from typing import Any, Callable, Iterator, Optional

from flax import errors as flax_errors
import flax.linen as linen
from flax import nnx
from flax.nnx import bridge as nnx_bridge
from flax.nnx import graph as nnx_graph
import jax
import jax.numpy as jnp
import numpy as np

from thor_optax._src import attention_keys
from thor_optax._src import capture as capture_lib
from thor_optax._src import layers as layers_lib
from thor_optax._src.layers import traced
from thor_optax._src import stats as stats_lib
from thor_optax._src import step_sharing


# handler(original, module, method, args, kwargs): original is the unpatched function.
_Handler = Callable[[Callable[..., Any], nnx.Module, str, tuple, dict], Any]

_local = threading.local()  # .handler: the innermost active handler of this thread
_patch_lock = threading.Lock()
_patch_depth = 0
_originals: dict[tuple[type, str], Any] = {}


def _wrapper(original: Callable[..., Any], method: str) -> Callable[..., Any]:
  """The replacement of ``cls.method``: the thread's handler if one is active, else original.
  A call of a patched method of a module the handler is already handling (a subclass's
  ``__call__`` calling ``super().__call__``, ``__call__`` calling ``self.encode``) goes to the
  original: it is part of that call, handled once."""

  @functools.wraps(original)
  def wrapped(self, *args, **kwargs):
    handler = getattr(_local, "handler", None)
    active = _local.__dict__.setdefault("active", set())
    if handler is None or traced.tracing_alone() or id(self) in active:
      return original(self, *args, **kwargs)
    active.add(id(self))
    try:
      return handler(original, self, method, args, kwargs)
    finally:
      active.discard(id(self))

  return wrapped


def _owner(cls: type, name: str) -> tuple[type, str]:
  """``(class, name)`` of the class in ``cls``'s MRO that defines the method ``name`` (patched
  once, however many registered classes inherit it)."""
  return next(c for c in cls.__mro__ if name in c.__dict__), name


@contextlib.contextmanager
def _intercept(handler: _Handler, model: Optional[nnx.Module] = None) -> Iterator[None]:
  """Routes calls of the patched layer methods to ``handler`` within the block: those of the
  registered kinds' NNX classes, and the methods of the classes of ``model``'s modules that a
  kind matching modules of any class takes (``__call__`` and their own public methods taking
  an input, ``traced.layer_methods``: Gemma's ``Embedder.encode`` and ``decode``).

  ``handler(original, module, method, args, kwargs)`` gets ``original``, the unpatched function
  (``original(module, *args, **kwargs)`` is not intercepted again), and returns the call's
  result. The classes not patched yet are patched on entry of every block (another thread's
  capture may hold the patches of another model's classes), and all are restored when the
  outermost block ends.
  """
  global _patch_depth
  with _patch_lock:
    pairs = list(layers_lib.intercepted("nnx")) + [(c, m) for c in _any_class_layers(model)
                                                    for m in traced.layer_methods(c)]
    for cls, name in dict.fromkeys(_owner(c, m) for c, m in pairs):
      if (cls, name) not in _originals:
        original = cls.__dict__[name]
        _originals[(cls, name)] = original
        setattr(cls, name, _wrapper(original, name))
    _patch_depth += 1
  previous = getattr(_local, "handler", None)
  _local.handler = handler
  try:
    yield
  finally:
    _local.handler = previous
    with _patch_lock:
      _patch_depth -= 1
      if _patch_depth == 0:
        for (cls, name), original in _originals.items():
          setattr(cls, name, original)
        _originals.clear()


def _any_class_layers(model: Optional[nnx.Module]) -> list[type]:
  """The classes of ``model``'s modules taken by a kind that names no NNX classes (one that
  matches modules of any class by what they hold: the ``'matmul'`` kind)."""
  if model is None:
    return []
  found = []
  for _, node in nnx.iter_graph(model):
    if isinstance(node, nnx.Module):
      kind = layers_lib.kind_of_module(node)
      if kind is not None and not kind.nnx_modules and type(node) not in found:
        found.append(type(node))
  return found


class _Channel(nnx.Param):
  """A variable the capture attaches to a layer of the model copy, for one pass.

  A ``Param`` subclass, so that NNX lifted transforms (``nnx.scan``, ``nnx.vmap``,
  ``nnx.remat``, and ``nnx.StateAxes`` filters on ``nnx.Param``) slice, stack and return it
  exactly as they do the layer's own parameters: the way a zero perturbation with the layer's
  stack axes reaches a lifted layer, and its recorded input comes back out.
  """


_PATH = "_thor_path"  # static attribute (kept in the graphdef through lifted transforms)
_PROBE = "_thor_probe"  # discovery: written by every __call__ (dropped under a scan broadcast)
_PERTURBATION = "_thor_perturbation"
_INPUT = "_thor_input"
# step_sharing.StepChannels.steps (inputs: _INPUT, cotangents: _PERTURBATION)
_STEPS = "_thor_steps"


def _layers(model: nnx.Module) -> dict[tuple[Any, ...], nnx.Module]:
  """``{path: module}`` of the model's modules of a registered kind that own parameters (a
  shared module: its first path, the one ``nnx.split`` files its variables under)."""
  out: dict[tuple[Any, ...], nnx.Module] = {}
  for path, node in nnx.iter_graph(model):
    if (isinstance(node, nnx.Module) and layers_lib.kind_of_module(node) is not None
        and _own_param(node) is not None):
      out.setdefault(tuple(path), node)
  return out


class _CallKwargs:
  """The model call's keyword arguments, with the NNX objects among them (call-time
  ``rngs=nnx.Rngs(...)``) split into a graph definition and state: each traced pass calls the
  model with its own merged copy (an NNX object made outside a trace cannot be mutated inside
  it), and the capture's forward pass hands the copies' new state back (:meth:`update`), so
  that the RNG streams advance as in a plain call."""

  def __init__(self, kwargs: dict):
    self.plain = {k: v for k, v in kwargs.items() if not nnx_graph.is_graph_node(v)}
    self.nodes = {k: v for k, v in kwargs.items() if nnx_graph.is_graph_node(v)}
    self.split = nnx.split(self.nodes) if self.nodes else None

  def fresh(self, state: Any = None) -> tuple[dict, Optional[dict]]:
    """``(keyword arguments, the NNX copies among them or None)`` for one traced call (the
    copies' state: ``state``, or theirs when given ``None``)."""
    if self.split is None:
      return dict(self.plain), None
    graphdef, own = self.split
    copies = nnx.merge(graphdef, own if state is None else state, copy=True)
    return {**self.plain, **copies}, copies

  def state(self) -> Any:
    """The NNX copies' state (``None`` without any), to pass into a traced pass."""
    return None if self.split is None else self.split[1]

  def update(self, state: Any) -> None:
    """Writes the copies' state after the capture's pass into the caller's objects."""
    if state is not None:
      nnx.update(self.nodes, state)


def _shared_params(model: nnx.Module) -> dict[tuple[Any, ...], str]:
  """``{path: reason}`` of the registered-kind layers holding an ``nnx.Param`` that another
  module holds too (``self.b.kernel = self.a.kernel``: weights tied across layers, which
  ``nnx.split`` files under the first path only): listed, not captured."""
  holders: dict[int, list[tuple[tuple[Any, ...], str]]] = {}
  for path, node in nnx.iter_graph(model):
    if isinstance(node, nnx.Module):
      for name, v in sorted(vars(node).items()):
        if isinstance(v, nnx.Param):
          holders.setdefault(id(v), []).append((tuple(path), name))
  reasons: dict[tuple[Any, ...], str] = {}
  modules = dict((tuple(p), n) for p, n in nnx.iter_graph(model))
  for held in holders.values():
    for path, name in held if len(held) > 1 else ():
      if layers_lib.kind_of_module(modules.get(path)) is None:
        continue
      others = [capture_lib.path_name(p) + "." + n for p, n in held if (p, n) != (path, name)]
      reasons[path] = (f"its parameter {name!r} is the same nnx.Param as {', '.join(others)} "
                       "(weights tied across layers are not preconditioned; their gradients "
                       "pass through)")
  return reasons


def _own_param(mod: nnx.Module) -> Optional[jax.Array]:
  """The value of the module's first own parameter by attribute name (``None`` if it has
  none); inside a lifted transform, as the layer sees it (one slice of a stack)."""
  for _, v in sorted(vars(mod).items()):
    if isinstance(v, nnx.Param) and not isinstance(v, _Channel):
      return v.get_value()
  return None


def _tagged(copy: nnx.Module) -> dict[tuple[Any, ...], nnx.Module]:
  """:func:`_layers` of a model copy, each tagged with its path (a static attribute, which NNX
  keeps in the graph definition, so that the copies a lifted transform makes carry it)."""
  layers = _layers(copy)
  for path, mod in layers.items():
    setattr(mod, _PATH, path)
  return layers


def _batched(v: Any) -> bool:
  """Whether ``v`` is mapped by an enclosing ``vmap`` (``nnx.vmap``) being traced: a
  ``BatchTracer``, which JAX does not export, so it is recognized by class name."""
  return any(t.__name__ == "BatchTracer" for t in type(v).__mro__)


def _module_reasons(model: nnx.Module, params: nnx.State) -> dict[tuple[Any, ...], str]:
  """Why each module holding ``Param`` leaves would be unhandled if no captured call is seen."""
  modules = {}
  for path, node in nnx.iter_graph(model):
    if isinstance(node, nnx.Module):
      modules.setdefault(tuple(path), node)
  paths = [tuple(path) for path, _ in nnx.to_flat_state(params)]
  reasons = capture_lib.unsupported_reasons(paths)
  for owner in reasons:
    if layers_lib.kind_of_module(modules.get(owner)) is not None:
      reasons[owner] = ("not called in the forward pass, or called where its variables cannot "
                        "be written: inside a raw jax transform (jax.lax.scan, jax.checkpoint) "
                        "instead of its nnx counterpart, or closed over by the function of an "
                        "nnx transform (nnx.scan, nnx.vmap, nnx.remat; pass the layer as an "
                        "argument, with in_axes=None for one applied at every step, to have it "
                        "captured)")
  return capture_lib.bridged_reasons(
      reasons, [p for p, m in modules.items() if isinstance(m, nnx_bridge.ToNNX)], "linen")


def _discover(graphdef: Any, params: Any, rest: Any, inputs: Any,
              call_kwargs: _CallKwargs) -> tuple[dict, dict, dict, frozenset, dict]:
  """Calls, shapes and metadata of every registered layer (a traced pass, no FLOPs).

  Returns ``(calls, input_dtypes, reasons, keys, noted)``, ``noted`` as
  :attr:`_Discovery.noted`, ``keys`` the paths of the key projections
  of attention written by hand (``attention_keys.shift_invariant`` on the pass's jaxpr, whose
  last outputs are the model's), ``reasons`` of the layers applied to an input that
  depends on no example (``capture.not_per_example``: a relative-position bucket table,
  learned latents or a buffer; the call's keywords and the model's RNG streams count as per
  example, its buffers and batch statistics do not). A layer run inside an NNX lifted
  transform is seen as a copy that carries its path; its stack axes are the leading axes of
  its parameters that the copy does not see (``nnx.scan`` / ``nnx.vmap`` over a stack of
  layers). A layer whose
  unstacked weights are applied at every iteration is marked shared: under ``nnx.vmap`` its
  input is mapped while its weights are not; under ``nnx.scan`` the write of its probe channel
  either does not come out of the loop (a cell broadcast into the loop: the probe's output is
  its input variable in the pass's jaxpr) or comes out as the loop's carry (``nnx.RNN``
  carries its cell's state: the probe's output is a ``scan`` output while the layer is not one
  of a stack).
  """
  own = {path: _own_param(mod)
         for path, mod in _layers(nnx.merge(graphdef, params, rest, copy=True)).items()}
  found = _Discovery({path: tuple(v.shape) for path, v in own.items()})
  order = list(found.outer)
  # The model's other state in two parts: its RNG streams (an input drawn from them is per
  # example) and the rest (buffers, batch statistics: as the parameters, the same for every
  # example). The probes come last, where _mark_scan_shared reads them.
  rngs, kept = nnx.split_state(rest, nnx.RngState, ...)
  # The call's keyword arrays (a second model input, ``ids=``) are traced inputs too, so that
  # a layer applied to them is seen to depend on the examples (``not_per_example``).
  plain, plain_def = jax.tree.flatten(call_kwargs.plain)
  arrays = [i for i, leaf in enumerate(plain) if isinstance(leaf, (jax.Array, np.ndarray))]

  def run(p, kept, rngs, x_in, kw_state, kw_arrays, probes):
    copy = nnx.merge(graphdef, p, kept, rngs, copy=True)
    found.layers = _tagged(copy)
    for path, probe in zip(order, probes):
      setattr(found.layers[path], _PROBE, _Channel(probe))
    found.top = jax.extend.core.get_opaque_trace_state(convention="nnx")
    leaves = list(plain)
    for i, leaf in zip(arrays, kw_arrays):
      leaves[i] = leaf
    with _intercept(found.record, copy):
      out = copy(x_in, **{**call_kwargs.fresh(kw_state)[0],
                          **jax.tree.unflatten(plain_def, leaves)})
    return ([getattr(found.layers[path], _PROBE).get_value() for path in order],
            dict(found.inputs), [y for y in jax.tree.leaves(out) if isinstance(y, jax.Array)])

  probes = [jax.ShapeDtypeStruct(own[path].shape, own[path].dtype) for path in order]
  closed, shapes = jax.make_jaxpr(run, return_shape=True)(
      params, kept, rngs, inputs, call_kwargs.state(), [plain[i] for i in arrays], probes)
  _mark_scan_shared(closed.jaxpr, order, found.written, found.calls)
  reasons = capture_lib.not_per_example(closed.jaxpr, shapes, shapes[1],
                                        len(jax.tree.leaves((params, kept))),
                                        capture_lib.batch_size(inputs))
  n_out = len(closed.jaxpr.outvars)
  keys = attention_keys.shift_invariant(
      closed.jaxpr, [i >= n_out - len(shapes[2]) for i in range(n_out)], found.marks)
  # A layer called inside a raw JAX transform (its variables cannot be written there) is left
  # to _module_reasons, which lists it; its calls elsewhere are dropped with it.
  return ({path: seen for path, seen in found.calls.items() if path not in found.raw},
          found.dtypes, {**{path: why for path, why in reasons.items() if path not in found.raw},
                         **found.refused}, keys,
          {path: tuple(flags) for path, flags in found.noted.items()})


@dataclasses.dataclass
class _Discovery:
  """What the discovery pass's interceptor (:meth:`record`) finds, layer by layer.

  Attributes:
    outer: ``{path: shape}`` of each registered layer's own parameter in the model.
    calls: the :class:`capture.Call` s by path; ``dtypes``: each layer's input dtype.
    written: layers whose probe channel a ``__call__`` wrote.
    raw: layers called inside a raw JAX transform (their variables cannot be written there).
    refused: ``{path: reason}`` of layers of a ``live_plan`` kind called on other than one
      array (listed).
    noted: ``{path: [noted, ...]}``: for each call of a method the layer's kind intercepts, in
      order, whether it was noted in ``calls`` (``capture.NotedCalls``).
    inputs: each layer's input, when called on the pass's own trace (not in a lifted copy).
    layers: the pass's model copy's layers by path; ``top``: the pass's JAX trace.
    marks: the layers whose outputs are routed through ``attention_keys.Marks``.
  """

  outer: dict
  calls: dict = dataclasses.field(default_factory=dict)
  dtypes: dict = dataclasses.field(default_factory=dict)
  written: set = dataclasses.field(default_factory=set)
  raw: set = dataclasses.field(default_factory=set)
  refused: dict = dataclasses.field(default_factory=dict)
  noted: dict = dataclasses.field(default_factory=dict)
  inputs: dict = dataclasses.field(default_factory=dict)
  layers: dict = dataclasses.field(default_factory=dict)
  top: Any = None
  marks: attention_keys.Marks = dataclasses.field(default_factory=attention_keys.Marks)

  def record(self, original, mod, method, args, kwargs):
    """The interceptor: calls the layer and notes the call (see :func:`_discover`)."""
    path = getattr(mod, _PATH, None)
    out = _call_naming_the_layer(original, mod, method, args, kwargs, path)
    if path not in self.outer:
      return out
    kind = layers_lib.kind_of_module(mod)
    if not kind.intercepts(mod, method):
      return out
    flags = self.noted.setdefault(path, [])
    flags.append(False)
    if kind.live_plan and not capture_lib.one_array_input(args, kwargs):
      if method == "__call__":  # another method so called is left to used_outside_their_calls
        self.refused.setdefault(path, capture_lib.not_one_array_reason(mod, args, kwargs))
      return out
    inner = _own_param(mod)
    stack = self.outer[path][:len(self.outer[path]) - inner.ndim]
    x = capture_lib.primary_input(args, kwargs)
    shared = "nnx.vmap" if not stack and _batched(x) and not _batched(inner) else ""
    if path in self.raw:
      return out
    if method == "__call__":
      try:
        getattr(mod, _PROBE).set_value(inner)
      except flax_errors.TraceContextError:  # inside a raw jax transform: listed
        self.raw.add(path)
        return out
      self.written.add(path)
    out, plan, kind = capture_lib.marked(self.marks, kind, mod, method, args, kwargs, out,
                                         path)
    if kind.live_plan and plan is None:
      return out  # a method that is no use of the module's weight
    capture_lib.note_call(self.calls, path, mod, method, args, kwargs, out, stack, shared,
                          lifted=mod is not self.layers[path], kind=kind, plan=plan)
    flags[-1] = True
    self.dtypes[path] = x.dtype
    if ((method == "__call__" or path not in self.inputs) and mod is self.layers[path]
        and jax.extend.core.get_opaque_trace_state(convention="nnx") == self.top):
      self.inputs[path] = x  # (another method's: its first use)
    return out


def _call_naming_the_layer(original: Callable, mod: nnx.Module, method: str, args: tuple,
                           kwargs: dict, path: Any) -> Any:
  """``original(mod, *args, **kwargs)``; an exception it raises gets a note naming the layer
  (Python >= 3.11) and is raised as it is."""
  try:
    return original(mod, *args, **kwargs)
  except Exception as e:
    if path is not None and hasattr(e, "add_note"):
      e.add_note(f"in {type(mod).__name__}.{method} of the layer at "
                 f"'{capture_lib.path_name(path)}' (thor_optax.nnx capture)")
    raise


def _mark_scan_shared(jaxpr: Any, order: list, written: set, calls: dict) -> None:
  """Marks ``shared_over='nnx.scan'`` the calls of each layer whose probe write (the last
  ``len(order)`` inputs and the outputs of the discovery pass's ``jaxpr``) never left an
  ``nnx.scan`` (a broadcast cell), or came out of a loop as its carry (``nnx.RNN`` carries its
  cell's state) while the layer is not one of a stack."""
  probe_vars = jaxpr.invars[len(jaxpr.invars) - len(order):]
  for path, var_in, var_out in zip(order, probe_vars, jaxpr.outvars):
    if path in written and (var_out is var_in or (
        _from_loop(jaxpr, var_out) and not any(c.stack for c in calls[path]))):
      calls[path] = [c._replace(shared_over="nnx.scan") for c in calls[path]]


def _from_loop(jaxpr: Any, var: Any) -> bool:
  """Whether ``var`` of ``jaxpr`` is an output of a ``scan`` or ``while`` equation, directly or
  through call-like equations (``pjit``, ``checkpoint``, ...) holding one sub-jaxpr."""
  for eqn in jaxpr.eqns:
    if not any(v is var for v in eqn.outvars):
      continue
    if eqn.primitive.name in ("scan", "while"):
      return True
    inner = [v for k, v in eqn.params.items() if k in ("jaxpr", "call_jaxpr", "fun_jaxpr")]
    if len(inner) != 1:
      return False
    inner = getattr(inner[0], "jaxpr", inner[0])
    i = next(i for i, v in enumerate(eqn.outvars) if v is var)
    return (len(inner.outvars) == len(eqn.outvars)
            and _from_loop(inner, inner.outvars[i]))
  return False


def _forward(graphdef: Any, rest: Any, inputs: Any, call_kwargs: _CallKwargs, captured: dict,
             dtypes: dict, noted: dict, params: Any, perts: dict
             ) -> tuple[Any, tuple[dict, Any]]:
  """A fresh copy's forward pass that records captured layers' inputs (``x_hat`` for
  normalized-input kinds) and perturbs their outputs; returns its new non-``Param`` state.

  Each captured layer of the copy gets two :class:`_Channel` variables: its perturbation
  (zeros of its output shape with its stack axes) and its input record, so that layers run
  inside lifted transforms receive their slice and hand their input back like parameters. A
  layer shared over a loop's iterations (``captured[path]['steps']``) gets its
  ``step_sharing.StepChannels`` in the same variables (and ``_STEPS``), which the loop body
  reads as loop invariants and attaches to every iteration (``step_sharing.tap``). A layer
  with several uses gets them in order (``noted``: which of its intercepted calls the discovery
  pass noted, ``capture.NotedCalls``)."""
  copy = nnx.merge(graphdef, params, rest, copy=True)
  layers = _tagged(copy)
  used = {path: [] for path, c in captured.items() if c["uses"]}  # weight sharing
  uses = capture_lib.NotedCalls(noted, {})
  for path, c in captured.items():
    if path in used:
      continue
    if c["steps"]:
      for name, value in ((_INPUT, perts[path].inputs), (_PERTURBATION, perts[path].cotangents),
                          (_STEPS, perts[path].steps)):
        setattr(layers[path], name, _Channel(value))
      continue
    setattr(layers[path], _PERTURBATION, _Channel(perts[path]))
    shape = tuple(c["stack"]) + tuple(c["input_shape"])
    setattr(layers[path], _INPUT, _Channel(jnp.zeros(shape, dtypes[path])))

  def intercept(original, mod, method, args, kwargs):
    path = getattr(mod, _PATH, None)
    if path in used and uses.use(path, mod, method):  # the i-th use of a shared layer
      used[path].append(capture_lib.primary_input(args, kwargs))
      return original(mod, *args, **kwargs) + perts[path][len(used[path]) - 1]
    if method != "__call__" or path not in captured:
      return original(mod, *args, **kwargs)
    kind = captured[path]["kind"]
    if captured[path]["steps"]:
      ch = step_sharing.StepChannels(*(getattr(mod, name).get_value()
                                       for name in (_INPUT, _PERTURBATION, _STEPS)))
      return step_sharing.tap(original(mod, *args, **kwargs),
                              capture_lib.primary_input(args, kwargs), ch)
    if not kind.normalized_input:
      getattr(mod, _INPUT).set_value(capture_lib.primary_input(args, kwargs))
      return original(mod, *args, **kwargs) + getattr(mod, _PERTURBATION).get_value()
    # x_hat's copy is made before the layer's own call
    plain = kind.unit_affine(mod, captured[path]["out"].dtype, captured[path]["meta"])
    out = original(mod, *args, **kwargs)
    getattr(mod, _INPUT).set_value(jax.lax.stop_gradient(original(plain, *args, **kwargs)))
    return out + getattr(mod, _PERTURBATION).get_value()

  kwargs, nodes = call_kwargs.fresh()
  with _intercept(intercept, copy):
    outputs = copy(inputs, **kwargs)
  layer_inputs = {path: getattr(layers[path], _INPUT).get_value() for path in captured
                  if path not in used and not captured[path]["steps"]}
  layer_inputs.update({path: tuple(xs) for path, xs in used.items()})
  _, _, new_rest = nnx.split(copy, nnx.Param, ...)  # the channels are Params: not in new_rest
  return outputs, (layer_inputs, (new_rest, None if nodes is None else nnx.state(nodes)))


def value_and_grad_with_stats(
    loss_fn: Callable[[jax.Array, Any], jax.Array],
    *,
    fisher_type: str = "empirical",
    likelihood: Optional[str] = None,
    num_samples: int = 1,
    loss_reduction: str = "mean",
    num_loss_terms: Optional[int] = None,
    weight_sharing: str = "auto",
    wrt: Any = nnx.Param,
) -> Callable[..., Any]:
  """Loss, gradients and per-layer curvature statistics of a Flax NNX model, in one pass.

  The NNX counterpart of ``thor_optax.flax.value_and_grad_with_stats``: the model is not edited (the
  captured layer classes are patched while the capture runs; see the module docstring). Captured:
  ``nnx.Linear`` (any number of leading axes), ``nnx.LinearGeneral`` and ``nnx.Einsum``
  (``nnx.MultiHeadAttention``'s projections; an einsum that is a matrix product per position),
  ``nnx.Conv`` (1-D, 2-D or 3-D, channels last, grouped or depthwise, unmasked, SAME/VALID/explicit
  or 1-D CAUSAL padding; grouped ones, and 1-D and 3-D ones without bias, need
  ``layers=thor_optax.captured_layers(stats)``), ``nnx.Embed`` (tied or not), ``nnx.BatchNorm``,
  ``nnx.LayerNorm``, ``nnx.GroupNorm`` and ``nnx.RMSNorm`` (scale and/or bias over the last axis;
  ``RMSNorm``: scale only), each called once per forward pass, directly or inside ``nnx.remat``,
  ``nnx.scan`` or ``nnx.vmap`` (a stack of layers whose parameters have leading layer axes:
  statistics per layer of the stack; weights applied at every iteration, as a recurrent cell's, get
  K-FAC-reduce over the iterations, see the module docstring), or used several times directly in the
  forward pass (weight sharing: every use joins the layer's statistics).

  Args:
    loss_fn: scalar training loss of the model output and the targets,
      ``loss_fn(model(inputs), targets)``.
    fisher_type: which cotangents form ``G``: ``'empirical'`` (the training loss's, no extra
      pass), ``'sampled'`` (``num_samples`` targets per example drawn from the model's
      predictive ``likelihood``; ``fn`` then needs ``rng``) or ``'exact'`` (every one of the
      ``K`` outputs weighted by the predictive distribution; ``K`` backward passes).
    likelihood: the predictive distribution of the sampled and exact types,
      ``'softmax_cross_entropy'`` or ``'squared_error'`` (unit-variance Gaussian).
    num_samples: ``S`` of ``'sampled'``.
    loss_reduction: how ``loss_fn`` reduces over its terms: ``'mean'`` (the cotangents are
      rescaled to per-term ones) or ``'sum'``; the factors are the mean's either way, so a
      summed loss's step is ``M`` times a mean loss's, as with SGD.
    num_loss_terms: how many terms the loss averages or sums (``N`` examples, ``N * T``
      positions);
      ``None`` reads it from the output's leading axes, which needs one output array of rank
      >= 2 (a model returning a tuple, dict or dataclass, or a rank-1 array, must state it).
    weight_sharing: ``'auto'`` (default), ``'expand'`` or ``'reduce'``: how a layer applied at
      every position folds the positions into its factors (see
      ``thor_optax.flax.value_and_grad_with_stats``).
    wrt: an NNX filter of the parameters to train, the ``wrt`` of ``nnx.Optimizer(model, tx,
      wrt=...)`` (default ``nnx.Param``). With a narrower one (a frozen backbone,
      ``nnx.All(nnx.Param, nnx.Not(nnx.PathContains('backbone')))``) the gradients hold only
      those parameters, as ``nnx.grad(..., argnums=nnx.DiffState(0, wrt))`` gives them, and
      the statistics only the layers with one of them (the optimizer, which sees only those
      layers, rejects statistics of others as those of another model).

  Returns:
    ``fn(model, inputs, targets, /, rng=None, **call_kwargs) -> ((loss, grads), stats)``,
    which calls ``model(inputs, **call_kwargs)`` once (e.g. ``train=True``, a ``mask`` or the
    model's own ``targets`` go in ``call_kwargs``: the first three arguments are positional
    only), where:

    * ``grads`` is what ``nnx.grad(lambda m: loss_fn(m(inputs), targets))(model)`` gives: an
      ``nnx.State`` of the model's ``nnx.Param`` variables (those ``wrt`` selects), ready for
      ``nnx.Optimizer(model, tx, wrt=nnx.Param).update(model, grads, curvature_stats=stats)``;
    * ``stats`` is a :class:`CurvatureStats` whose ``layers`` nest like ``grads`` at every
      captured layer (``stats.layers['blocks'][0]['linear']`` for the module at
      ``model.blocks[0].linear``): :class:`DenseStats` (inputs ``(N, ..., d_in)``, cotangents
      ``(S, N, ..., d_out)``), :class:`ConvStats` (inputs ``(N, spatial..., C)``),
      :class:`EmbedStats` (ids ``(N, ...)``, cotangents ``(S, N, ..., features)``) or
      :class:`NormStats` (``(S, N, C)`` scale and bias gradients per loss term). Cotangents are
      per example: ``N`` times those of a mean loss. ``unhandled`` lists, as ``"path: reason"``
      with ``/``-joined paths, the modules with parameters that were not captured (layers called
      more than once, tied embeddings, unsupported convolutions or normalization axes, other
      module kinds); their gradients pass through the transforms unchanged.

    The model's non-``Param`` state (``nnx.BatchStat`` running averages of a training-mode
    BatchNorm, ``nnx.Rngs`` counts used by dropout, other variables) is updated in place exactly
    as by ``model(inputs, **call_kwargs)``; ``fn`` may be called inside ``nnx.jit``.

  Raises:
    ValueError: on an unknown ``fisher_type``, ``likelihood``, ``loss_reduction`` or
      ``weight_sharing``, a sampled
      or exact Fisher without a ``likelihood``, ``num_samples < 1`` or a bad
      ``num_loss_terms``; from ``fn``, for a sampled Fisher called without ``rng``, outputs
      whose number of loss terms cannot be read from their shape, or a sampled or exact Fisher
      of a model that does not return one array.
    ValueError: from ``fn``, if ``wrt`` selects variables that are not ``nnx.Param``.
    TypeError: if ``loss_fn`` is a module rather than a function (the model goes to ``fn``);
      from ``fn``, if ``model`` is not an ``nnx.Module`` (e.g. a linen module: use
      ``thor_optax.flax.value_and_grad_with_stats``).

  References:
    Martens & Grosse, K-FAC, ICML 2015, section 5 (sampled targets for the true Fisher).
    kfac-jax ``tracer.py`` (output perturbations); Flax NNX functional API (split/merge/update).
  """
  if isinstance(loss_fn, (nnx.Module, linen.Module)) or not callable(loss_fn):
    raise TypeError(
        f"thor_optax.nnx.value_and_grad_with_stats takes the loss function, got "
        f"{type(loss_fn).__name__}: capture = value_and_grad_with_stats(loss_fn), then "
        "(loss, grads), stats = capture(model, inputs, targets)"
        + (" (a linen module: thor_optax.flax.value_and_grad_with_stats(model, loss_fn))"
           if isinstance(loss_fn, linen.Module) else "") + ".")
  options = capture_lib.FisherOptions(fisher_type, likelihood, num_samples, loss_reduction,
                                      num_loss_terms, weight_sharing)

  def fn(model, inputs, targets, /, rng=None, **kwargs):
    options.check_rng(rng)
    if not isinstance(model, nnx.Module):
      raise TypeError(
          f"value_and_grad_with_stats (NNX) needs an nnx.Module, got {type(model).__name__}; "
          "for a linen module use thor_optax.flax.value_and_grad_with_stats.")
    if wrt is not nnx.Param:
      _check_wrt(model, wrt)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    capture_lib.check_rng_keyword(type(model).__call__, rng,
                                  "thor_optax.nnx.value_and_grad_with_stats")
    call_kwargs = _CallKwargs(kwargs)
    calls, dtypes, unbatched, keys, noted = capture_lib.one_input(
        lambda: _discover(graphdef, params, rest, inputs, call_kwargs),
        "thor_optax.nnx.value_and_grad_with_stats")
    tied = {**unbatched, **_shared_params(model)}
    outside = {**capture_lib.used_outside_their_calls(
        functools.partial(_zeroed_forward, graphdef, rest, inputs, call_kwargs, noted), params,
        {path: seen for path, seen in calls.items() if path not in tied}), **tied}
    captured, unhandled = capture_lib.plan_calls(calls, _module_reasons(model, params),
                                                 shared=outside,
                                                 weight_sharing=options.weight_sharing,
                                                 attention_keys=keys)
    forward = functools.partial(_forward, graphdef, rest, inputs, call_kwargs, captured, dtypes,
                                {p: noted[p] for p, c in captured.items() if c["uses"]})
    loss, grads, stats, (new_rest, new_nodes) = capture_lib.vjp_with_stats(
        forward, params, captured, unhandled, loss_fn, targets, rng, options)
    nnx.update(model, new_rest)
    call_kwargs.update(new_nodes)
    if wrt is not nnx.Param:
      grads = nnx.state(grads, wrt)
      stats = _trained_layers_only(stats, grads)
    return (loss, grads), stats

  return fn


def _check_wrt(model: nnx.Module, wrt: Any) -> None:
  """Raises ``ValueError`` if ``wrt`` selects variables that are not ``nnx.Param`` (a
  trainable ``nnx.Variable`` subclass of the user's): the capture differentiates the model's
  ``Param`` leaves only, so their gradients would be missing."""
  others = [tuple(path) for path, _ in nnx.to_flat_state(
      nnx.state(model, nnx.All(wrt, nnx.Not(nnx.Param))))]
  if others:
    names = ", ".join(capture_lib.path_name(p) for p in others[:4])
    raise ValueError(
        f"thor_optax.nnx.value_and_grad_with_stats: wrt selects variables that are not "
        f"nnx.Param ({names}{', ...' if len(others) > 4 else ''}); the capture differentiates "
        "nnx.Param leaves only, so their gradients would be missing. Make them nnx.Param (a "
        "subclass of it), or train them with another optimizer outside this capture.")


def _zeroed_forward(graphdef, rest, inputs, call_kwargs, noted, params):
  """The model's outputs with every use the discovery pass noted (``noted``,
  ``capture.NotedCalls``) returning zeros of its output's shape
  (``capture.used_outside_their_calls``)."""
  uses = capture_lib.NotedCalls(noted, {})

  def zeroed(original, mod, method, args, kwargs):
    use = uses.use(getattr(mod, _PATH, None), mod, method)
    out = original(mod, *args, **kwargs)
    return capture_lib.zeroed_output(out, (args, kwargs)) if use else out

  copy = nnx.merge(graphdef, params, rest, copy=True)
  _tagged(copy)
  with _intercept(zeroed, copy):
    return copy(inputs, **call_kwargs.fresh()[0])


def _trained_layers_only(stats: stats_lib.CurvatureStats,
                         grads: Any) -> stats_lib.CurvatureStats:
  """``stats`` without the layers (and notes) of modules that have no leaf in ``grads``."""
  trained = {stats_lib.layer_name(stats_lib.path_keys(path)[:-1])
             for path, _ in jax.tree_util.tree_flatten_with_path(grads)[0]}

  def prune(tree, keys):
    if stats_lib.is_layer_stats(tree):
      return tree if stats_lib.layer_name(keys) in trained else None
    kept = {k: prune(v, keys + (str(k),)) for k, v in tree.items()}
    return {k: v for k, v in kept.items() if v is not None and not (isinstance(v, dict)
                                                                     and not v)}

  return dataclasses.replace(
      stats, layers=prune(stats.layers, ()),
      unhandled=tuple(note for note in stats.unhandled if note.split(": ", 1)[0] in trained),
      exact_rows=tuple(name for name in stats.exact_rows if name in trained))
