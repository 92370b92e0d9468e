"""Capture of curvature statistics from an unchanged Flax linen model.

``value_and_grad_with_stats(model, loss_fn)`` returns a function that, in one forward and one
backward pass, gives the loss, the parameter gradients and the curvature statistics of every
captured layer. It wraps ``model.apply`` in ``flax.linen.intercept_methods``: each captured
layer's input is recorded and a zero perturbation is added to its output, so the cotangent of
that perturbation, returned by the same ``jax.vjp`` that gives the parameter gradients, is the
layer's output cotangent.

What does not depend on how calls are intercepted is shared with the Flax NNX capture
(``nnx_capture.py``): which calls are captured and why others are not (:func:`plan_calls`, which
asks each module's registered layer kind, ``layers/``), the Fisher options
(:class:`FisherOptions`) and the ``vjp`` that turns recorded inputs and output cotangents into
each kind's statistics (:func:`vjp_with_stats`).

Captured layer kinds (see ``layers/*.py``):

* ``nn.Dense`` -> ``DenseStats`` (input, output cotangents);
* ``nn.DenseGeneral`` -> ``DenseGeneralStats``, ``nn.Einsum`` (an equation that is a matrix
  product per position) -> ``EinsumStats`` (both flattened to a dense layer's);
* ``nn.Conv`` (1-D, 2-D or 3-D, grouped or depthwise, unmasked; SAME, VALID, explicit or 1-D
  CAUSAL padding) -> ``ConvStats`` (grouped convolutions, and 1-D and 3-D ones without bias,
  need the capture's layout, ``layers=thor_optax.captured_layers(stats)``: their kernel shapes
  do not show them);
* ``nn.Embed`` -> ``EmbedStats`` (token ids, output cotangents; for a tied embedding also its
  ``attend`` inputs and logit cotangents);
* ``nn.BatchNorm``, ``nn.LayerNorm``, ``nn.GroupNorm`` and ``nn.RMSNorm`` with scale and/or
  bias over the last axis only (``RMSNorm``: scale only) -> ``NormStats`` (scale and bias
  gradients per loss term);
* modules of no Flax class, recognised from their calls traced alone (``layers/traced.py``): a
  product by one weight (``'matmul'``), a scale and shift per entry (``'channel_affine'``), an
  embedding table looked up and perhaps applied as the tied output by methods of its own
  (``'lookup'``: Gemma's ``Embedder.encode`` / ``decode``), and an embedding's table given
  transposed to a ``nn.Dense`` applied with ``.apply()`` (Hugging Face's tied LM head,
  ``tied_outputs.py``);
* modules of kinds registered with ``thor_optax.register_layer_kind``.

A layer called once is captured through its own ``params`` scope, directly or inside lifted
transforms; a layer whose weights are used several times directly in the forward pass (called
twice, an embedding's ``__call__`` and ``attend``, Gemma's ``Embedder.encode`` and ``decode``
of the ``'lookup'`` kind) is weight sharing: every use is recorded and
perturbed in the forward trace and the kind joins them (:func:`shared_uses`); a layer whose
weights a lifted loop applies at every iteration (an ``nn.RNN`` / ``nn.scan`` cell with
``variable_broadcast='params'``, a layer broadcast into ``nn.vmap``) gets K-FAC-reduce over the
iterations from zero channels the loop body closes over (``step_sharing.py``).

For a normalization layer (a kind with ``normalized_input``) the interceptor also needs
``x_hat``, the normalized input before scale and bias. It is recomputed by applying an unbound
clone of the module without its affine map (the kind's ``unit_affine``: ``use_scale=False``
and, where the class has a bias, ``use_bias=False``, in the layer's output dtype) to the same
arguments, with the layer's non-parameter collections (``batch_stats``) as read before the
layer runs and ``mutable=True`` so that a training-mode BatchNorm may update its (discarded)
copy of the running statistics. The clone's statistics are the layer's own (the batch's, or the
running averages), and ``x_hat`` is never formed as ``(y - bias) / scale``, which fails for a
zero scale (zero-init residual BatchNorm). Model parameters, ``batch_stats`` and the model's
outputs are untouched.

Fisher types:

* ``'empirical'``: cotangents of the training loss (no extra pass);
* ``'sampled'``: targets drawn from the model's predictive distribution (softmax for
  ``likelihood='softmax_cross_entropy'``, unit-variance Gaussian for ``'squared_error'``),
  their cotangents pushed through the same forward pass by a second ``vjp`` call;
* ``'exact'``: every output direction weighted by the predictive distribution (``K`` backward
  passes for ``K`` outputs): the exact output-space Fisher, for small models and tests.

References:
  Martens & Grosse, K-FAC, ICML 2015, section 5 (sampled targets for the true Fisher).
  Osawa et al., SP-NGD, TPAMI 2020, "Fast estimation with empirical Fisher".
  kfac-jax ``tracer.py``: zero perturbations of layer outputs give output cotangents in one vjp.
  Ioffe & Szegedy, "Batch Normalization", ICML 2015, section 3 (``y = scale * x_hat + bias``).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from typing import (Any, Callable, Collection, Iterable, Mapping, NamedTuple, Optional, Sequence,
                    Union)

import flax.linen as nn
from flax import nnx
from flax.nnx import bridge as nnx_bridge
import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jax_core

from thor_optax._src import attention_keys
from thor_optax._src import example_rows
from thor_optax._src import layers as layers_lib
from thor_optax._src import stats as stats_lib
from thor_optax._src import step_sharing
from thor_optax._src import tied_outputs
from thor_optax._src.layers import base as layer_base
from thor_optax._src.layers import traced
from thor_optax._src.layers.base import one_array_input, primary_input

FISHER_TYPES = ("empirical", "sampled", "exact")
LIKELIHOODS = ("softmax_cross_entropy", "squared_error")


def not_one_array_reason(mod: Any, args: tuple, kwargs: dict) -> str:
  """Why a call of a :attr:`~thor_optax._src.layers.base.LayerKind.live_plan` kind's module
  that is not on one array and Python constants (:func:`one_array_input`) is listed."""
  return (f"{type(mod).__name__} holds a weight, but a call of it is not on one array and "
          f"Python constants (given {len(args)} positional and {sorted(kwargs)} keyword "
          "arguments); register a layer kind for it (thor_optax.register_layer_kind)")


def unsupported_reasons(leaf_paths: Iterable[tuple[Any, ...]]) -> dict[tuple[Any, ...], str]:
  """``{module path: reason}`` for modules no registered kind takes, naming their parameters
  (a bare ``self.param('pos', ...)`` of the root module shows up as ``(root)``). Parameters of
  a module that also has submodules with parameters (a ViT's class token and position
  embeddings next to its patch convolution, a BEiT layer's layer scales) are said to be such:
  the capture takes a module's call as a whole, and only a module of their own is one."""
  leaves: dict[tuple[Any, ...], list] = {}
  for path in leaf_paths:
    leaves.setdefault(tuple(path[:-1]), []).append(str(path[-1]))

  def reason(module, names):
    quoted = ", ".join(repr(n) for n in sorted(names))
    plural = len(names) > 1
    verb = "pass" if plural else "passes"
    if any(len(other) > len(module) and other[:len(module)] == module for other in leaves):
      return (f"parameter{'s' * plural} {quoted} of a module that also has submodules, used in "
              f"its own call (a class token, a position embedding, a layer scale), {verb} "
              "through unpreconditioned: the capture takes a module's call as a whole. A "
              "position embedding added, or a layer scale multiplied, in a module of its own "
              "is captured (the 'channel_affine' kind)")
    return (f"module kind not supported (parameter{'s' * plural} {quoted} {verb} "
            "through unpreconditioned; thor_optax.register_layer_kind can take it)")

  return {module: reason(module, names) for module, names in leaves.items()}


def bridged_reasons(reasons: dict[tuple[Any, ...], str], bridges: Iterable[tuple[Any, ...]],
                    other_api: str) -> dict[tuple[Any, ...], str]:
  """``reasons`` with those of modules under an ``nnx.bridge`` wrapper (at a path of
  ``bridges``) saying so: the capture does not follow the other API's modules inside it."""
  bridges = [tuple(b) for b in bridges]
  return {owner: (f"inside an nnx.bridge wrapper, whose {other_api} layers this capture does "
                  "not follow (their gradients pass through): capture that part with its own "
                  "API's value_and_grad_with_stats, or write its layers in this one"
                  if any(owner[:len(b)] == b for b in bridges) else why)
          for owner, why in reasons.items()}


def output_cotangents(outputs: jax.Array, dloss: jax.Array, num_terms: int, fisher_type: str,
                      likelihood: Optional[str], num_samples: int,
                      rng: Optional[jax.Array]) -> jax.Array:
  """Per-example cotangents at the model output, ``(S, *outputs.shape)``.

  ``G`` is formed as the sum over ``S`` of the per-example cotangent covariance, so every
  variant below is scaled to make that sum the intended Fisher factor.

  Args:
    outputs: model outputs, ``(N, ..., K)``.
    dloss: gradient of the (mean) training loss w.r.t. ``outputs``.
    num_terms: the factor that makes ``dloss`` one term's (``M`` for a mean loss of ``M``
      terms, 1 for a summed loss); the empirical type only.
    fisher_type: ``'empirical'``, ``'sampled'`` or ``'exact'``.
    likelihood: ``'softmax_cross_entropy'`` or ``'squared_error'`` (``0.5 ||y - f||^2`` per
      example) for the sampled and exact types.
    num_samples: ``S`` for ``'sampled'``.
    rng: PRNG key for ``'sampled'``.

  Returns:
    ``(S, *outputs.shape)`` cotangents (``S = 1`` empirical, ``num_samples`` sampled, ``K``
    exact).

  Raises:
    ValueError: on an unknown ``fisher_type`` or ``likelihood``, ``num_samples < 1``, a
      ``num_terms`` that is not a positive int, a ``dloss`` not shaped like ``outputs``, or a
      sampled Fisher without one PRNG key (:class:`FisherOptions`).

  Source: Martens & Grosse, ICML 2015 (the Fisher with targets sampled from the model's
  predictive distribution); Kunstner et al., NeurIPS 2019 (the empirical Fisher).
  """
  options = FisherOptions(fisher_type, likelihood, num_samples, num_loss_terms=num_terms)
  options.check_rng(rng)
  if np.shape(dloss) != np.shape(outputs):
    raise ValueError(f"output_cotangents: dloss must have the outputs' shape "
                     f"{np.shape(outputs)}, got {np.shape(dloss)}.")
  if fisher_type == "empirical":
    return (dloss * num_terms)[None]
  f = outputs.astype(jnp.promote_types(outputs.dtype, jnp.float32))
  k = f.shape[-1]
  if fisher_type == "sampled":
    scale = 1.0 / math.sqrt(num_samples)
    if likelihood == "softmax_cross_entropy":
      labels = jax.random.categorical(rng, f, shape=(num_samples,) + f.shape[:-1])
      ct = jax.nn.softmax(f) - jax.nn.one_hot(labels, k, dtype=f.dtype)
    else:
      ct = jax.random.normal(rng, (num_samples,) + f.shape, f.dtype)
    return (scale * ct).astype(outputs.dtype)
  # exact: sum over all K outputs of weighted cotangents.
  eye = jnp.eye(k, dtype=f.dtype).reshape((k,) + (1,) * (f.ndim - 1) + (k,))
  if likelihood == "softmax_cross_entropy":
    p = jax.nn.softmax(f)
    weight = jnp.sqrt(jnp.moveaxis(p, -1, 0))[..., None]
    ct = weight * (p[None] - eye)
  else:
    ct = jnp.broadcast_to(eye, (k,) + f.shape)
  return ct.astype(outputs.dtype)


def used_positions(loss_fn: Callable[[Any, Any], jax.Array], outputs: jax.Array, targets: Any,
                   dloss: jax.Array) -> jax.Array:
  """``(N, ..., 1)`` booleans: the output positions the loss reads, for the sampled and exact
  Fisher, whose cotangents are drawn or enumerated at every position whatever the loss: a
  position the loss drops (padding, a masked token, an LM's last position) has a gradient of
  exactly zero in every output, ``dloss``, and also at outputs moved by a fixed perturbation
  (which tells it from a term whose gradient happens to vanish, an exact fit of a squared
  error or a saturated softmax). Those positions' cotangents are zeroed, so that ``G`` sums
  over the loss's own terms (weights other than 0 and 1 are not read).

  Source: this project; the Fisher of a loss of ``M`` terms sums over those terms (Martens &
  Grosse, ICML 2015, section 5).
  """
  moved = outputs + jax.random.normal(jax.random.key(0), outputs.shape, outputs.dtype)
  _, probe = loss_and_output_cotangents(loss_fn, moved, targets)
  return (jnp.any(dloss != 0, axis=-1, keepdims=True)
          | jnp.any(probe != 0, axis=-1, keepdims=True))


@dataclasses.dataclass(frozen=True)
class FisherOptions:
  """The Fisher options of a capture, validated on construction.

  Attributes:
    fisher_type: ``'empirical'``, ``'sampled'`` or ``'exact'``.
    likelihood: ``'softmax_cross_entropy'``, ``'squared_error'`` or ``None`` (empirical only).
    num_samples: targets drawn per example for ``'sampled'`` (``>= 1``).
    loss_reduction: ``'mean'`` or ``'sum'``.
    num_loss_terms: the number of terms the loss averages or sums (``N`` examples, or
      ``N * T`` positions), or ``None`` to read it from the output's leading axes
      (:func:`loss_terms`).
    weight_sharing: how layers shared over positions fold them, ``'auto'``, ``'expand'`` or
      ``'reduce'`` (``LayerKind.per_loss_term``).

  Raises:
    ValueError: on an unknown ``fisher_type``, ``likelihood`` or ``loss_reduction``, a sampled
      or exact Fisher without a ``likelihood``, ``num_samples < 1``, or a ``num_loss_terms``
      that is not a positive int.
  """

  fisher_type: str = "empirical"
  likelihood: Optional[str] = None
  num_samples: int = 1
  loss_reduction: str = "mean"
  num_loss_terms: Optional[int] = None
  weight_sharing: str = "auto"

  def __post_init__(self):
    if self.weight_sharing not in layer_base.WEIGHT_SHARING:
      raise ValueError(f"weight_sharing must be one of {layer_base.WEIGHT_SHARING}, got "
                       f"{self.weight_sharing!r}")
    if self.fisher_type not in FISHER_TYPES:
      raise ValueError(
          f"fisher_type must be one of {FISHER_TYPES}, got {self.fisher_type!r}")
    if self.fisher_type != "empirical" and self.likelihood not in LIKELIHOODS:
      raise ValueError(f"fisher_type={self.fisher_type!r} needs likelihood in {LIKELIHOODS}, "
                       f"got {self.likelihood!r}")
    if self.loss_reduction not in ("mean", "sum"):
      raise ValueError(
          f"loss_reduction must be 'mean' or 'sum', got {self.loss_reduction!r}")
    if self.num_samples < 1:
      raise ValueError(f"num_samples must be >= 1, got {self.num_samples}")
    n = self.num_loss_terms
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
      raise ValueError(f"num_loss_terms must be a positive Python int (the number of terms the "
                       f"loss averages or sums) or None, got {n!r}.")

  def check_rng(self, rng: Optional[jax.Array]) -> None:
    """Raises ``ValueError`` if the Fisher type draws targets and ``rng`` is not one PRNG key
    (``jax.random.key(0)`` or a raw ``jax.random.PRNGKey(0)``)."""
    if self.fisher_type != "sampled":
      return
    if rng is None:
      raise ValueError(
          "fisher_type='sampled' draws targets from the model: pass rng=<PRNGKey>.")
    dtype = rng.dtype if isinstance(rng, (jax.Array, np.ndarray)) else None
    typed = dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
    if not (typed and rng.shape == () or not typed and dtype == jnp.uint32
            and len(rng.shape) == 1):
      got = (f"an array of shape {rng.shape} and dtype {dtype}" if dtype is not None
             else f"a {type(rng).__name__}")
      raise ValueError(
          f"fisher_type='sampled': rng must be one PRNG key, jax.random.key(seed) or "
          f"jax.random.PRNGKey(seed) (a batch of keys: pass one of them; nnx.Rngs: pass "
          f"a key drawn from it, rngs()), got {got}.")


class Call(NamedTuple):
  """One call of an intercepted method of a registered kind's module, seen in an abstract pass.

  Attributes:
    module: the module (linen: bound inside the pass; NNX: the model copy's layer).
    method: the method's name (``'__call__'``, ``'attend'``, ...).
    input_shape: shape of the primary input.
    out: ``ShapeDtypeStruct`` of the output (as the layer sees it inside any lifted transform).
    stack: leading axes of the module's parameters beyond those the layer sees (``(L,)`` for a
      stack of ``L`` layers under ``nn.scan`` / ``nn.vmap`` with ``variable_axes={'params':
      0}``), ``()`` otherwise.
    shared_over: the lifted transform (``'nn.scan'``, ``'nnx.vmap'``, ...) that applies the layer's
      unstacked weights at every iteration (an ``nn.RNN`` cell), ``''`` otherwise.
    lifted: whether the call runs inside a lifted transform (``nn.remat``, ``nnx.scan``, ...)
      rather than directly in the model's forward pass.
    kind: the module's layer kind, found while the module was live, or ``None``.
    plan: the kind's :class:`~thor_optax._src.layers.base.Plan` of a ``__call__``, made while
      the module was live (kept for a kind whose plan reads the module's variables,
      :attr:`~thor_optax._src.layers.base.LayerKind.live_plan`), or ``None``.
  """

  module: Any
  method: str
  input_shape: tuple[int, ...]
  out: jax.ShapeDtypeStruct
  stack: tuple[int, ...] = ()
  shared_over: str = ""
  lifted: bool = False
  kind: Optional[layer_base.LayerKind] = None
  plan: Optional[layer_base.Plan] = None


def note_call(calls: dict, path: tuple[Any, ...], mod: Any, method: str, args: tuple,
              kwargs: dict, out: Any, stack: tuple[int, ...] = (), shared_over: str = "",
              lifted: bool = False, kind: Optional[layer_base.LayerKind] = None,
              plan: Optional[layer_base.Plan] = None) -> None:
  """Records one call for :func:`plan_calls` (appends a :class:`Call` to ``calls[path]``)."""
  out_struct = (jax.ShapeDtypeStruct(out.shape, out.dtype) if hasattr(out, "shape") else None)
  calls.setdefault(path, []).append(
      Call(mod, method, tuple(primary_input(args, kwargs).shape), out_struct, tuple(stack),
           shared_over, lifted, kind, plan))


def path_name(path: tuple[Any, ...]) -> str:
  """``('Block_0', 'Dense_1')`` -> ``'Block_0/Dense_1'``; ``()`` -> ``'(root)'``: the layer names
  the transforms use (:func:`thor_optax._src.stats.layer_name`)."""
  return stats_lib.layer_name(path)


def plan_calls(calls: Mapping[tuple[Any, ...], list],
               module_reasons: Mapping[tuple[Any, ...], str],
               counts: Optional[Mapping[tuple[Any, ...], int]] = None,
               shared: Optional[Mapping[tuple[Any, ...], str]] = None,
               weight_sharing: str = "auto",
               attention_keys: Collection[tuple[Any, ...]] = ()) -> tuple[dict, dict]:
  """Which module calls are captured, and why the others are not.

  Args:
    calls: ``{module path: [Call, ...]}``, every call of an intercepted method of a registered
      layer kind's module in one forward pass, as :func:`note_call` records them.
    module_reasons: ``{module path: reason}`` for every module holding parameters: the reason it
      is listed as unhandled if no captured call was seen for it (e.g. ``'module kind not
      supported'``).
    counts: ``{module path: __call__ calls per forward pass}`` where the calls listed in
      ``calls`` overcount them (a body traced twice by a lifted ``nn.scan``); default: counted
      from ``calls``.
    shared: ``{module path: reason}`` for modules whose parameters are also used elsewhere
      (given to a module applied with ``.apply()``): listed, not captured.
    weight_sharing: the capture's option (``step_sharing.plan``: ``'expand'`` lists a layer
      shared over a loop's iterations).
    attention_keys: paths of the key projections of attention, found from the traced model
      (``attention_keys.shift_invariant``), which ``'auto'`` expands
      (:func:`layer_weight_sharing`).

  Returns:
    ``(captured, unhandled)``: ``captured[path] = dict(kind=, meta=, out=, input_shape=,
    stack=, uses=, steps=)`` with ``kind`` the module's ``LayerKind``, ``meta`` the static
    metadata of its statistics, ``out`` the output's ``ShapeDtypeStruct`` and ``input_shape``
    the primary input's shape (of one iteration inside a lifted loop), ``stack`` the leading
    stack axes of its parameters, ``uses`` ``None`` for a layer called once, or the calls
    (:class:`Call`) of a layer whose weights are used several times in the forward pass
    (weight sharing: a layer called twice, a tied embedding's ``__call__`` and ``attend``;
    :func:`shared_uses`), and ``steps`` the lifted loop (``'nn.scan'``, ...) that applies the
    layer's weights at every iteration (``step_sharing.py``), ``''`` otherwise;
    ``unhandled[path] = reason``.
  """
  unhandled: dict[tuple[Any, ...], str] = {}
  captured: dict[tuple[Any, ...], dict] = {}
  for path, seen in calls.items():
    first = seen[0]
    kind = first.kind or layers_lib.kind_of_module(first.module)
    methods = tuple(c.method for c in seen)
    plan = (kind.join_plans([c.plan for c in seen if c.plan is not None]) if kind.live_plan
            else kind.plan(first.module, methods, first.input_shape))
    if plan.meta is None and not plan.reason:
      continue  # no parameters, nothing to precondition
    n_calls = (counts or {}).get(path, sum(c.method == "__call__" for c in seen))
    sharing = n_calls > 1 or any(c.method != "__call__" for c in seen)
    methods, fields = kind.overridden(first.module)
    if methods or fields:
      what = " and ".join(
          ([f"overrides {', '.join(methods)} of the {kind.name} layer it subclasses"]
           if methods else [])
          + ([f"is given its own {', '.join(fields)}"] if fields else []))
      plan = layer_base.Plan(None, (
          f"{type(first.module).__name__} {what}, so the weight it applies may not be its "
          "parameter (e.g. weight standardization, an equalized learning rate); register a "
          "layer kind for it (thor_optax.register_layer_kind)"))
    elif first.shared_over:
      plan = step_sharing.plan(kind, plan, first.shared_over, first.stack, weight_sharing)
      sharing = False  # a loop body traced more than once is not several uses
    elif path in (shared or {}):
      plan = layer_base.Plan(None, shared[path])
    elif sharing:
      plan = shared_uses(kind, plan, seen, n_calls)
    if plan.meta is None:
      unhandled[path] = plan.reason
      continue
    captured[path] = dict(kind=kind, meta=plan.meta, out=first.out,
                          input_shape=first.input_shape, stack=first.stack,
                          uses=tuple(seen) if sharing else None, steps=first.shared_over,
                          weight_sharing=layer_weight_sharing(weight_sharing,
                                                              path in attention_keys))
  for path, reason in {**module_reasons, **(shared or {})}.items():
    if path not in captured and path not in unhandled:
      unhandled[path] = reason
  return captured, unhandled


def layer_weight_sharing(weight_sharing: str, attention_key: bool) -> str:
  """How one layer folds its positions: the capture's ``weight_sharing``, except that
  ``'auto'`` expands the key projection of an attention module. Softmax is invariant to a
  shift of all keys, so a key's output cotangents sum to zero over the positions of each
  example, exactly: K-FAC-reduce's ``G`` (cotangents summed per example) would vanish and the
  key would keep the identity for ``G`` (the check step rejects a factor that vanishes next to
  its damping), a step ``1 / sqrt(lambda)`` times smaller than its neighbours'. Expand keeps
  the rows; the key's gradient is ``a^T g`` of them (Eschenhagen et al., NeurIPS 2023)."""
  return "expand" if weight_sharing == "auto" and attention_key else weight_sharing


def shared_uses(kind: layer_base.LayerKind, plan: layer_base.Plan, seen: Sequence[Call],
                n_calls: int) -> layer_base.Plan:
  """The plan of a layer whose weights are used several times in one forward pass.

  Weight sharing (Eschenhagen et al., NeurIPS 2023): every use is a set of positions of the one
  weight, folded as the capture's ``weight_sharing`` says. Captured when the kind can join its
  uses (:attr:`LayerKind.shares_weights`: dense layers called several times, an embedding's
  ``__call__`` and ``attend``), every use runs directly in the forward pass (not inside a lifted
  transform, which may trace it more than once) and on the same number of examples; otherwise
  the plan lists the layer with the reason.
  """
  methods = [c.method for c in seen]
  what = (f"called {n_calls} times per forward pass (shared layer)"
          if set(methods) == {"__call__"} else
          f"{' and '.join(sorted(set(methods)))} used in one forward pass (shared layer, e.g. a "
          "tied embedding)")
  if plan.meta is None:
    return plan
  if not kind.shares_weights:
    return layer_base.Plan(None, f"{what}: weight sharing of a {kind.name!r} layer is not "
                           "preconditioned")
  if any(c.lifted or c.stack for c in seen):
    return layer_base.Plan(None, f"{what} inside a lifted transform: weight sharing is "
                           "preconditioned for layers used directly in the forward pass")
  if len({c.input_shape[:1] for c in seen}) > 1:
    return layer_base.Plan(None, f"{what} on different numbers of examples "
                           f"{sorted({c.input_shape[:1] for c in seen})}")
  return plan


def _set_nested(tree: dict, path: tuple[Any, ...], value: Any) -> Any:
  """``tree`` with ``value`` at ``path`` (``value`` itself for the root path ``()``)."""
  if not path:
    return value
  node = tree
  for key in path[:-1]:
    node = node.setdefault(key, {})
  node[path[-1]] = value
  return tree


def _curvature_stats(captured: Mapping[tuple[Any, ...], dict],
                     unhandled: Mapping[tuple[Any, ...], str],
                     layer_inputs: Mapping[tuple[Any, ...], jax.Array],
                     cts: Mapping[tuple[Any, ...], jax.Array],
                     num_terms: int, gradient_divisor: int, weight_sharing: str,
                     empirical: bool) -> stats_lib.CurvatureStats:
  """Each captured layer's statistics, built by its kind from the recorded inputs (``x_hat``
  for normalization layers) and the per-term output cotangents, folded for ``num_terms`` loss
  terms; a stack of layers (``stack=(L,)``) gets its kind's statistics with a leading ``L``
  axis on every field. ``gradient_divisor``: ``M`` for a mean loss, 1 for a summed one (a
  layer's gradient is ``a^T g / gradient_divisor``).
  ``empirical``: the cotangents are the training loss's own (one sample), so layers whose
  rows give their gradient are listed in ``exact_rows``."""
  layers: Any = {}
  exact = []
  for path, c in captured.items():
    kind = c["kind"]
    if not kind.integer_inputs:  # uint8 images, int features: cast as Flax casts them
      like = jnp.result_type(jax.tree_util.tree_leaves(cts[path])[0])
      layer_inputs = {**layer_inputs, path: jax.tree_util.tree_map(
          lambda x, like=like: x if jnp.issubdtype(x.dtype, jnp.inexact) else x.astype(like),
          layer_inputs[path])}
    if c["steps"]:  # shared over a loop's iterations: the channels' sums
      layers = _set_nested(layers, path, step_sharing.stats(
          kind, c["meta"], layer_inputs[path], cts[path].cotangents, num_terms))
      continue
    if c["uses"]:  # weight sharing: one statistics of every use
      raw = kind.make_shared_stats(tuple(u.method for u in c["uses"]), layer_inputs[path],
                                   cts[path], **c["meta"])
      folded = kind.per_loss_term(raw, num_terms, c.get("weight_sharing", weight_sharing))
    else:
      def make(x, g, kind=kind, meta=c["meta"], sharing=c.get("weight_sharing", weight_sharing)):
        raw = kind.make_stats(x, g, **meta)
        return raw, kind.per_loss_term(raw, num_terms, sharing)

      for _ in c["stack"]:  # inputs (L, N, ...), cotangents (S, L, N, ...)
        make = jax.vmap(make, in_axes=(0, 1))
      raw, folded = make(layer_inputs[path], cts[path])  # ``raw`` is dead code under jit
    layers = _set_nested(layers, path, folded)
    if empirical and kind.gradient_from_rows and _same_sizes(raw, folded):
      exact.append(path_name(path))
  notes = tuple(f"{path_name(p)}: {why}"
                for p, why in sorted(unhandled.items(), key=lambda kv: path_name(kv[0])))
  stacked = tuple(sorted((path_name(p), len(c["stack"])) for p, c in captured.items()
                         if c["stack"] and not c["steps"]))
  return stats_lib.CurvatureStats(layers=layers, unhandled=notes, exact_rows=tuple(sorted(exact)),
                                  num_loss_terms=gradient_divisor, stacked=stacked)


def _same_sizes(raw: Any, folded: Any) -> bool:
  """Whether folding the positions per loss term kept every row (K-FAC-expand, or no
  positions), rather than averaging them away (K-FAC-reduce)."""
  return [x.size for x in jax.tree.leaves(raw)] == [x.size for x in jax.tree.leaves(folded)]


def loss_terms(outputs: Any, options: "FisherOptions") -> int:
  """The number of terms ``M`` the loss averages or sums.

  A summed loss's cotangents are per term already, a mean loss's are ``1/M`` of them; either
  way ``M`` decides how layers shared over positions fold them (``LayerKind.per_loss_term``),
  so a summed loss gets the factors of the mean of the same terms.

  Args:
    outputs: the model's outputs (any pytree).
    options: the capture's options (``loss_reduction``, ``num_loss_terms``).

  Returns:
    ``num_loss_terms`` if given; else, for one output array of rank >= 2, the product of its
    leading axes (``N`` examples, or ``N * T`` positions).

  Raises:
    ValueError: without ``num_loss_terms``, for outputs that are not one array of rank >= 2 (a
      tuple, dict or dataclass of outputs, or a rank-1 array such as ``Dense(1)(x)[..., 0]``):
      their number of loss terms cannot be read from shapes.
  """
  if options.num_loss_terms is not None:
    return options.num_loss_terms
  leaves = jax.tree_util.tree_leaves(outputs)
  if len(leaves) == 1 and leaves[0] is outputs and outputs.ndim >= 2:
    return math.prod(outputs.shape[:-1])
  what = (f"a rank-{outputs.ndim} array of shape {outputs.shape}" if len(leaves) == 1
          and leaves[0] is outputs else f"a {type(outputs).__name__} of {len(leaves)} arrays")
  raise ValueError(
      f"thor_optax value_and_grad_with_stats: the model returns {what}, so the number of terms "
      f"the {options.loss_reduction} loss "
      f"{'sums' if options.loss_reduction == 'sum' else 'averages'} "
      "cannot be read from the output's leading axes. Pass num_loss_terms=<int> (e.g. the "
      "batch size N for a loss over examples, N * T for one over all positions).")


def check_rng_keyword(call: Callable[..., Any], rng: Any, where: str) -> None:
  """Raises ``ValueError`` if ``rng`` is given and ``call`` (the model's ``__call__``) takes a
  keyword ``rng`` of its own: the capture's ``rng`` (the sampled Fisher's key) would take it,
  and the model would silently get its default."""
  if rng is None:
    return
  try:
    takes = "rng" in inspect.signature(call).parameters
  except (TypeError, ValueError):
    return
  if takes:
    raise ValueError(
        f"{where}: the model's __call__ takes a keyword 'rng', and rng= is the capture's own "
        "(the key of the sampled Fisher): the model would not get it. Give the model its key "
        "under another name, or bind it in a wrapper (functools.partial of the model's "
        "__call__ in a small module).")


def one_input(discover: Callable[[], Any], where: str) -> Any:
  """``discover()`` (the capture's first pass over the model), with Python's error for a model
  that takes more positional inputs than the one the capture passes turned into a
  ``TypeError`` saying how to pass the others."""
  try:
    return discover()
  except TypeError as e:
    if "required positional argument" not in str(e):
      raise
    raise TypeError(
        f"{where}: the capture calls the model with one positional input, model(inputs, "
        f"**kwargs), and the model wants more ({e}). Pass the others as keywords of the "
        "capture's call (they go to the model), or give the model one input (a tuple or dict "
        "of them).") from e


def traced_outputs(trace: Callable[[], Any]) -> Any:
  """``trace()`` (a JAX transformation of the model's forward pass), with JAX's error for an
  output it cannot trace (a plain, unregistered dataclass) turned into a ``ValueError`` that
  says what to return instead.

  Raises:
    ValueError: if the model's outputs hold a value that is not a JAX type or pytree.
  """
  try:
    return trace()
  except TypeError as e:
    if "is not a valid JAX type" not in str(e):
      raise
    raise ValueError(
        "thor_optax value_and_grad_with_stats: the model's outputs hold a value JAX cannot "
        f"trace ({str(e).splitlines()[0]}). Return arrays in a tuple or dict, or make an "
        "output dataclass a pytree (flax.struct.dataclass, or "
        "jax.tree_util.register_dataclass).") from e


def loss_and_output_cotangents(loss_fn: Callable[[Any, Any], jax.Array], outputs: Any,
                               targets: Any) -> tuple[jax.Array, Any]:
  """The loss and its gradient with respect to the model's floating-point outputs.

  Args:
    loss_fn: ``loss_fn(outputs, targets) -> scalar``.
    outputs: the model's outputs, any pytree; integer or boolean leaves (``argmax``
      predictions returned beside the logits) get ``float0`` cotangents, Python numbers
      (``return logits, 0.0``) cotangents of their own dtype.
    targets: passed to ``loss_fn``.

  Returns:
    ``(loss, cotangents)``, the cotangents shaped like ``outputs``.

  Raises:
    ValueError: if ``loss_fn`` does not return one floating-point scalar (a per-example loss
      vector, a ``(loss, aux)`` tuple), naming what it returned.
  """
  leaves, treedef = jax.tree.flatten(outputs)
  floating = [jnp.issubdtype(jnp.result_type(leaf), jnp.inexact) for leaf in leaves]

  def of_floats(floats):
    it = iter(floats)
    return loss_fn(treedef.unflatten([next(it) if f else leaf
                                      for leaf, f in zip(leaves, floating)]), targets)

  loss, pullback = jax.vjp(of_floats, [leaf for leaf, f in zip(leaves, floating) if f])
  if not (isinstance(loss, jax.Array) and loss.shape == ()
          and jnp.issubdtype(loss.dtype, jnp.floating)):
    got = (f"an array of shape {loss.shape} and dtype {loss.dtype}"
           if isinstance(loss, jax.Array) else
           f"a {type(loss).__name__} of {len(jax.tree.leaves(loss))} leaves")
    raise ValueError(
        f"thor_optax value_and_grad_with_stats: loss_fn must return one floating-point scalar "
        f"(the loss averaged or summed over its terms), got {got}. A per-example loss: return "
        "its .mean() (or .sum() with loss_reduction='sum'); metrics such as accuracy: compute "
        "them from the model's outputs outside loss_fn (the capture returns no aux).")
  floats, = pullback(jnp.ones_like(loss))
  it = iter(floats)
  cotangents = [jnp.asarray(next(it)).astype(jnp.result_type(leaf)) if f
                else np.zeros(np.shape(leaf), jax.dtypes.float0)
                for leaf, f in zip(leaves, floating)]
  return loss, treedef.unflatten(cotangents)


def vjp_with_stats(
    forward: Callable[[Any, dict], tuple[Any, tuple[dict, Any]]],
    params: Any,
    captured: Mapping[tuple[Any, ...], dict],
    unhandled: Mapping[tuple[Any, ...], str],
    loss_fn: Callable[[Any, Any], jax.Array],
    targets: Any,
    rng: Optional[jax.Array],
    options: FisherOptions,
) -> tuple[jax.Array, Any, stats_lib.CurvatureStats, Any]:
  """Loss, gradients and statistics from one ``jax.vjp`` of an instrumented forward pass.

  Args:
    forward: ``forward(params, perturbations) -> (outputs, (layer_inputs, aux))``: the model's
      forward pass that adds ``perturbations[path]`` (zeros of the layer's output shape, with
      the leading stack axes of a stacked layer; for a layer with ``uses``, a tuple of them,
      one per use in call order) to the output of every captured layer and records its input
      (``x_hat`` for a normalization layer; a tuple per use) in ``layer_inputs[path]``; a
      layer with ``steps`` gets ``step_sharing.StepChannels`` instead, which it attaches at
      every iteration with ``step_sharing.tap`` and records nothing; ``outputs`` is any
      pytree; ``aux`` is passed through (e.g. updated model state).
    params: the differentiated parameters (any pytree).
    captured, unhandled: from :func:`plan_calls`.
    loss_fn: ``loss_fn(outputs, targets) -> scalar``, given the outputs exactly as the model
      returns them.
    targets: second argument of ``loss_fn``.
    rng: PRNG key for ``'sampled'``.
    options: the Fisher options.

  Returns:
    ``(loss, grads, stats, aux)``; ``grads`` has the structure of ``params``; ``stats`` is a
    :class:`CurvatureStats` whose layers nest by the keys of each captured path.

  Raises:
    ValueError: from :func:`loss_terms`; for a sampled or exact Fisher of a model whose output
      is not one array (the predictive distribution needs the logits).
  """
  def zeros(c):
    if c["steps"]:
      return step_sharing.channels(c["input_shape"], c["out"])
    if c["uses"]:
      return tuple(jnp.zeros(u.out.shape, u.out.dtype) for u in c["uses"])
    return jnp.zeros(tuple(c["stack"]) + tuple(c["out"].shape), c["out"].dtype)

  perturbations = {path: zeros(c) for path, c in captured.items()}
  outputs, vjp_fn, (layer_inputs, aux) = traced_outputs(
      lambda: jax.vjp(forward, params, perturbations, has_aux=True))
  loss, dloss = loss_and_output_cotangents(loss_fn, outputs, targets)
  grads, layer_cts = vjp_fn(dloss)
  # A layer shared over a loop's iterations: its input sums come back as gradients.
  layer_inputs = {**layer_inputs, **{path: layer_cts[path] for path, c in captured.items()
                                     if c["steps"]}}
  num_terms = loss_terms(outputs, options)
  # A mean loss's cotangents are 1/M of each term's; a summed loss's are the terms' own.
  per_term = num_terms if options.loss_reduction == "mean" else 1
  if options.fisher_type == "empirical":
    cts = jax.tree.map(lambda c: (c * per_term)[None], layer_cts)
  else:
    if not isinstance(outputs, jax.Array):
      raise ValueError(
          f"thor_optax value_and_grad_with_stats: fisher_type={options.fisher_type!r} draws "
          "targets from the model's predictive distribution, so the model must return one "
          f"array of logits; it returns a {type(outputs).__name__}. Use "
          "fisher_type='empirical', or capture a wrapper module that returns the logits.")
    out_cts = output_cotangents(outputs, dloss, per_term, options.fisher_type,
                                options.likelihood, options.num_samples, rng)
    out_cts = out_cts * used_positions(loss_fn, outputs, targets, dloss).astype(out_cts.dtype)
    cts = jax.vmap(lambda ct: vjp_fn(ct)[1])(out_cts)
  captured, layer_inputs, cts = _uses_reaching_the_loss(
      _reaching_the_loss(forward, params, perturbations, loss_fn, targets, captured),
      captured, layer_inputs, cts)
  stats = _curvature_stats(captured, unhandled, layer_inputs, cts, num_terms, per_term,
                           options.weight_sharing, options.fisher_type == "empirical")
  stats_lib.mark_captured_gradients(grads, stats)  # what a plain step from the rows stands for
  return loss, grads, stats, aux


def _reaching_the_loss(forward: Callable, params: Any, perturbations: dict,
                       loss_fn: Callable, targets: Any, captured: Mapping[tuple[Any, ...], dict]
                       ) -> dict[tuple[Any, ...], tuple[bool, ...]]:
  """``{path: (reaches, ...)}``, for each layer with several uses, whether each use's output
  reaches the loss (dead-code elimination of the loss's jaxpr in the perturbations; one more
  trace of the forward pass, only for models with such a layer). A call whose result the loss
  never reads (big_vision's ViT applies its head to every token too, ``logits_2d``, returned
  beside the logits the loss reads) is no use of the loss's Fisher. ``{}`` without such layers
  or where JAX lacks the elimination."""
  shared = [path for path, c in captured.items() if c["uses"]]
  if not shared:
    return {}
  order = list(perturbations)
  closed = jax.make_jaxpr(lambda perts: loss_fn(
      forward(params, dict(zip(order, perts)))[0], targets))([perturbations[p] for p in order])
  used = _used_inputs(closed.jaxpr)
  if used is None:
    return {}
  by_path, start = {}, 0
  for p in order:  # the flat inputs, path by path
    count = len(jax.tree.leaves(perturbations[p]))
    by_path[p], start = tuple(used[start:start + count]), start + count
  return {p: by_path[p] for p in shared}


def _uses_reaching_the_loss(reaching: Mapping[tuple[Any, ...], tuple[bool, ...]],
                            captured: Mapping[tuple[Any, ...], dict], layer_inputs: dict,
                            cts: dict) -> tuple[dict, dict, dict]:
  """``captured``, ``layer_inputs`` and ``cts`` with each shared layer's uses that do not
  reach the loss (:func:`_reaching_the_loss`) left out (all kept when none does: a layer whose
  gradient is zero); before, their inputs entered ``A`` with zero cotangents."""
  captured, layer_inputs, cts = dict(captured), dict(layer_inputs), dict(cts)
  for path, reaches in reaching.items():
    kept = [i for i, r in enumerate(reaches) if r]
    if not kept or len(kept) == len(reaches):
      continue
    captured[path] = {**captured[path], "uses": tuple(captured[path]["uses"][i] for i in kept)}
    layer_inputs[path] = tuple(layer_inputs[path][i] for i in kept)
    cts[path] = tuple(cts[path][i] for i in kept)
  return captured, layer_inputs, cts


@dataclasses.dataclass(frozen=True)
class _Apply:
  """``model.apply`` with the call's ``mutable`` and keyword arguments, as
  ``(outputs, mutated)`` (``mutated = None`` when ``model.apply`` returns outputs alone)."""

  model: nn.Module
  mutable: Any
  kwargs: dict

  @property
  def returns_state(self) -> bool:
    """Whether ``model.apply`` returns ``(outputs, mutated)`` rather than ``outputs``."""
    return self.mutable is not False or bool(self.kwargs.get("capture_intermediates", False))

  def instrumented(self, variables: dict, inputs: Any) -> tuple[Any, dict]:
    """``model.apply`` with the ``params`` collection mutable as well (the channel through which
    captured layers inside lifted transforms read their perturbations and record their inputs),
    returning ``(outputs, every mutated collection)``."""
    mutable = self.mutable
    if mutable is not True:
      names = [] if mutable is False else [mutable] if isinstance(mutable, str) else list(mutable)
      mutable = list(dict.fromkeys(names + ["params"]))
    kwargs = {k: v for k, v in self.kwargs.items() if k != "capture_intermediates"}
    out = self.model.apply(variables, inputs, mutable=mutable, **kwargs,
                           capture_intermediates=self.kwargs.get("capture_intermediates", False))
    return out

  def outputs(self, variables: dict, inputs: Any) -> Any:
    """The model's outputs alone, as ``model.apply`` with the call's arguments gives them."""
    kwargs = {k: v for k, v in self.kwargs.items() if k != "capture_intermediates"}
    out = self.model.apply(variables, inputs, mutable=self.mutable, **kwargs)
    return out[0] if self.mutable is not False else out

  def user_state(self, mutated: dict) -> Any:
    """The mutated collections as ``model.apply(..., mutable=self.mutable)`` returns them."""
    if not self.returns_state:
      return None
    if self.mutable is True or "params" in ([self.mutable] if isinstance(self.mutable, str)
                                            else list(self.mutable or [])):
      return {**mutated, "params": _strip_channels(mutated["params"])}
    return {k: v for k, v in mutated.items() if k != "params"}


_INPUTS = "~thor_inputs"  # a captured layer's recorded input, in its own params scope
_PERTURBATION = "~thor_perturbation"  # the zeros added to a captured layer's output
_CALLS = "~thor_calls"  # zeros((k,)) after k calls of a layer (counted through lifted scans)
_STEP_INPUTS = "~thor_step_inputs"  # step_sharing.StepChannels.inputs (with _PERTURBATION)
_STEPS = "~thor_steps"  # step_sharing.StepChannels.steps


def _strip_channels(tree: Any) -> Any:
  """A params dict without the capture's channel entries."""
  if not isinstance(tree, Mapping):
    return tree
  return {k: _strip_channels(v) for k, v in tree.items()
          if k not in (_INPUTS, _PERTURBATION, _CALLS, _STEP_INPUTS, _STEPS)}


def _get(tree: Any, path: tuple[Any, ...]) -> Any:
  """The node of a nested dict at ``path``, or ``None``."""
  for key in path:
    if not isinstance(tree, Mapping) or key not in tree:
      return None
    tree = tree[key]
  return tree


class _Context:
  """Where a linen call runs, relative to the model being captured.

  The capture's own ``model.apply`` has the root scope; a module run inside a lifted transform
  (``nn.remat``, ``nn.scan``, ``nn.vmap``, ``nn.jit``) has a root scope of its own whose path is
  its place in the model (and whose debug path names the transforms, ``'remat(scan(layers))'``);
  a module applied with ``.apply()`` inside the model (a separate variable tree) has a root
  scope with the empty path that is not the capture's.
  """

  def __init__(self, param_shapes: Mapping[tuple[str, ...], dict]):
    self.root = None
    self.param_shapes = param_shapes
    self.stack: list[tuple[str, ...]] = []  # paths of the model's modules being called
    self.methods: list[str] = []  # and the methods called
    self.trace = None  # the forward pass's JAX trace (set when it starts)

  def enter(self, mod: nn.Module) -> None:
    if self.root is None:
      self.root = mod.scope.root

  def traced_apart(self) -> bool:
    """Whether the call runs under another JAX trace than the forward pass (inside a
    ``jax.lax.cond`` branch, a loop body, ...), while its module is the model's own, not a
    lifted copy: values it records would escape that trace."""
    return jax.extend.core.get_opaque_trace_state(convention="nnx") != self.trace

  def foreign(self, mod: nn.Module) -> bool:
    """Whether ``mod`` belongs to a variable tree applied with ``.apply()`` inside the model."""
    root = mod.scope.root
    return root is not self.root and not root.path and not root.debug_path

  def nested(self, mod: nn.Module, method: str, kind: layer_base.LayerKind) -> bool:
    """Whether a call of ``mod``'s ``method`` runs inside a call of another method of the same
    module that ``kind`` intercepts, and is part of that use (``__call__`` calling
    ``self.encode``); a ``__call__`` inside a ``__call__`` of the same path is a lifted
    transform's body (``nn.scan``), which is the use."""
    path = tuple(mod.path)
    return any(p == path and kind.intercepts(mod, m) and (m != "__call__" or method != "__call__")
               for p, m in zip(self.stack, self.methods))

  def site(self) -> str:
    """The model module that is running (where a ``.apply()`` happens)."""
    return path_name(self.stack[-1]) if self.stack else path_name(())

  def placement(self, mod: nn.Module) -> Optional[tuple[tuple[int, ...], str]]:
    """``(stack, shared_over)`` of a module with parameters, ``None`` if it has none here."""
    outer = self.param_shapes.get(tuple(mod.path))
    inner = nn.meta.unbox(mod.variables.get("params", {}))  # boxed leaves have no shape
    name = next((k for k in sorted(outer or {}) if k in inner
                 and hasattr(inner[k], "shape")), None)
    if name is None:
      return None
    full, seen = outer[name], tuple(inner[name].shape)
    stack = full[:len(full) - len(seen)]
    lifted = " ".join(mod.scope.root.debug_path)
    mapped = next((f"nn.{t}" for t in ("scan", "vmap") if f"{t}(" in lifted), "")
    return stack, ("" if stack else mapped)


@dataclasses.dataclass
class _Recorder:
  """What the linen discovery pass's interceptor (:meth:`record`) finds (see
  :func:`_discover`).

  Attributes:
    ctx: where each call runs (:class:`_Context`).
    calls: the :class:`Call` s by module path.
    foreign: ``{site: module class}`` of the layers applied with ``.apply()``.
    transformed: ``{module path: reason}`` of the layers listed for how they are called.
    marks: the calls routed through ``attention_keys.Marks``.
    applied: the foreign calls of registered kinds' ``__call__`` (``tied_outputs.Applied``).
    sequence: ``(path, i)`` of the ``i``-th noted call of a path and ``(None, k)`` of
      ``applied[k]``, in call order.
    noted: ``{path: [noted, ...]}`` for each call of a method its kind intercepts.
  """

  ctx: _Context
  calls: dict = dataclasses.field(default_factory=dict)
  foreign: dict = dataclasses.field(default_factory=dict)
  transformed: dict = dataclasses.field(default_factory=dict)
  marks: attention_keys.Marks = dataclasses.field(default_factory=attention_keys.Marks)
  applied: list = dataclasses.field(default_factory=list)
  sequence: list = dataclasses.field(default_factory=list)
  noted: dict = dataclasses.field(default_factory=dict)

  def record_foreign(self, next_fun, args, kwargs, mod, method):
    """A call of a module applied with ``.apply()`` inside the model."""
    kind = layers_lib.kind_of_module(mod)
    if method != "__call__" or kind is None or traced.tracing_alone():
      return next_fun(*args, **kwargs)  # (a module traced alone is a copy of the model's)
    self.foreign[self.ctx.site()] = type(mod).__name__
    out = next_fun(*args, **kwargs)
    self.applied.append(tied_outputs.of(mod, kind, args, kwargs, out, self.ctx.traced_apart()))
    self.sequence.append((None, len(self.applied) - 1))
    return out

  def record(self, next_fun, args, kwargs, context):
    """The interceptor: calls the method and notes the call."""
    mod, method, ctx = context.module, context.method_name, self.ctx
    ctx.enter(mod)
    if ctx.foreign(mod):
      return self.record_foreign(next_fun, args, kwargs, mod, method)
    path, kind = tuple(mod.path), layers_lib.kind_of_module(mod)
    if kind is not None and kind.intercepts(mod, method):
      slot = len(self.noted.setdefault(path, []))
      self.noted[path].append(False)
    if kind is not None and kind.live_plan and ctx.nested(mod, method, kind):
      return next_fun(*args, **kwargs)  # part of the module's outer call, its use
    ctx.stack.append(path)
    ctx.methods.append(method)
    try:
      out = next_fun(*args, **kwargs)
    finally:
      ctx.stack.pop()
      ctx.methods.pop()
    if kind is None or not kind.intercepts(mod, method):
      return out
    if kind.live_plan and not one_array_input(args, kwargs):
      if method == "__call__":  # another method so called is left to used_outside_their_calls
        self.transformed.setdefault(path, not_one_array_reason(mod, args, kwargs))
      return out
    why = _not_lifted_reason(mod, ctx)
    if why:
      self.transformed[path] = why
      return out
    out, plan, kind = marked(self.marks, kind, mod, method, args, kwargs, out, path)
    if kind.live_plan and plan is None:
      return out  # a method that is no use of the module's weight
    place = ctx.placement(mod)
    stack, shared_over = place if place is not None else ((), "")
    note_call(self.calls, path, mod, method, args, kwargs, out, stack, shared_over,
              lifted=mod.scope.root is not ctx.root, kind=kind, plan=plan)
    self.sequence.append((path, len(self.calls[path]) - 1))
    self.noted[path][slot] = True
    if place is not None and not shared_over:
      _write_probes(mod, method, primary_input(args, kwargs))
    return out


def _discover(apply: _Apply, params: Any, model_state: dict, inputs: Any) -> tuple:
  """Calls, shapes and metadata of every registered kind's module (an abstract pass, no FLOPs).

  Returns ``(calls, counts, foreign, transformed, keys, tied, noted)``: the :class:`Call`\\ s by
  module path; the number of ``__call__`` calls of each captured-kind module with parameters
  per forward pass (counted through the params channel, so a lifted scan's second trace of its
  body does not count); ``{site: module class}`` of layers applied with ``.apply()`` inside
  the model; ``{module path: reason}`` of layers run inside ``nn.map_variables``
  (``nn.WeightNorm``, ``nn.SpectralNorm``), whose applied weight is a function of their
  parameter: listed; the paths of attention key projections, found from the pass's jaxpr
  (``attention_keys.shift_invariant``: Flax's attention modules and attention written by
  hand alike); ``{k: embedding path}`` of the ``k``-th foreign call (of a registered kind's
  ``__call__``) when it is that embedding's tied output, ``Dense.apply({'params': {'kernel':
  embedding.T}}, h)`` (``tied_outputs.py``), which is then among the embedding's calls as its
  ``attend``; and ``{module path: (noted, ...)}``, for each call of a method its kind
  intercepts, in the order the calls begin, whether it was noted in ``calls`` (a call inside
  another of the same module, one on more than one array or one that reads no weight is not),
  which the forward pass follows to find a shared layer's uses.
  """
  found = _Recorder(_Context({path: {k: tuple(v.shape) for k, v in leaves.items()}
                              for path, leaves in _module_leaves(params).items()}))
  calls, transformed, applied = found.calls, found.transformed, found.applied
  closed, (outputs, mutated, _) = _trace_discovery(
      apply, found.record, found.ctx, params, model_state, inputs,
      lambda: [a.kernel for a in applied if a.kernel is not None])
  linked = tied_outputs.link(closed.jaxpr, applied, params, calls, Call)
  tied_outputs.in_call_order(calls, linked, found.sequence)
  keys = attention_keys.shift_invariant(
      closed.jaxpr, [i < len(outputs) for i in range(len(closed.jaxpr.outvars))], found.marks)
  counts = {path: _get(mutated, path)[_CALLS].shape[-1] for path in calls
            if _CALLS in (_get(mutated, path) or {})}
  probes = {path: _get(mutated, path)[_INPUTS] for path in calls
            if _INPUTS in (_get(mutated, path) or {})}
  given = len(jax.tree.leaves((params, model_state)))  # the pass's inputs before the examples
  for path, why in not_per_example(closed.jaxpr, (outputs, mutated), probes, given,
                                   batch_size(inputs)).items():
    transformed.setdefault(path, why)
  return calls, counts, found.foreign, transformed, keys, {
      k: p for k, (p, _) in linked.items()}, {p: tuple(f) for p, f in found.noted.items()}


def _write_probes(mod: nn.Module, method: str, x: Any) -> None:
  """Writes, beside the parameters of a module called once per iteration of the pass, what
  ``_discover`` reads back: a ``__call__``'s count (``_CALLS``, one more per call) and its input
  (``_INPUTS``, for :func:`not_per_example`), or another method's input at its module's first
  use."""
  if method == "__call__":
    seen = (mod.scope.get_variable("params", _CALLS)
            if mod.scope.has_variable("params", _CALLS) else jnp.zeros((0,)))
    mod.scope.put_variable("params", _CALLS, jnp.zeros((seen.shape[-1] + 1,)))
    mod.scope.put_variable("params", _INPUTS, x)
  elif not mod.scope.has_variable("params", _INPUTS):
    mod.scope.put_variable("params", _INPUTS, x)


def marked(marks: attention_keys.Marks, kind: layer_base.LayerKind, mod: Any, method: str,
           args: tuple, kwargs: dict, out: Any, path: tuple[Any, ...]
           ) -> tuple[Any, Optional[layer_base.Plan], layer_base.LayerKind]:
  """``(out, plan, kind)`` of one call of a registered kind's layer: ``out`` marked for the
  attention-key analysis (``attention_keys.Marks``) with the output's positions when it is a
  call the kind plans, the kind's plan (``None`` for a method it does not plan: a tied
  embedding's ``attend``, noted unmarked, or a method of a module of any class that is no use
  of its weight, not noted), and the kind (:func:`live_plan` for a module of any class)."""
  if kind.live_plan:
    kind, plan = live_plan(kind, mod, method, args, kwargs)
  else:
    plan = kind.plan_call(mod, args, kwargs) if method == "__call__" else None
  if plan is None or plan.meta is None:
    marks.skip(path)
    return out, plan, kind
  return marks.mark(out, path, kind.output_positions(plan.meta, jnp.ndim(out))), plan, kind


def live_plan(kind: layer_base.LayerKind, mod: Any, method: str, args: tuple, kwargs: dict
              ) -> tuple[layer_base.LayerKind, Optional[layer_base.Plan]]:
  """``(kind, plan)`` of one call of a module that kinds of any class match (one weight: a
  product for ``'matmul'``, a shift for ``'channel_affine'``, a lookup or its tied ``decode``
  for ``'lookup'``): each plans the call (:meth:`~layer_base.LayerKind.plan_method`) in
  registry order until one captures it; otherwise the reason of the first one for the input's
  type lists it (integer ids: the ``'lookup'`` kind's); ``(kind, None)`` when none takes the
  call for a use of the weight."""
  x = primary_input(args, kwargs)
  ids = jnp.issubdtype(jnp.result_type(x), jnp.integer) if hasattr(x, "dtype") else False
  refused = []
  for other in (kind,) + tuple(k for k in layers_lib.kinds_of_module(mod)
                               if k is not kind and k.live_plan):
    plan = other.plan_method(mod, method, args, kwargs)
    if plan is not None and plan.meta is not None:
      return other, plan
    if plan is not None:
      refused.append((other, plan))
  if not refused:
    return kind, None
  return next((p for p in refused if p[0].integer_inputs == ids), refused[0])


def _not_lifted_reason(mod: nn.Module, ctx: _Context) -> str:
  """Why a call of a registered kind cannot be captured as its module's own (``''``: it can):
  it runs under a transform it is not lifted through, or inside ``nn.map_variables``."""
  if mod.scope.root is ctx.root and ctx.traced_apart():
    return (f"called inside a transform it is not lifted through (a branch of nn.cond / "
            f"nn.switch or the body of nn.while_loop closing over the {type(mod).__name__} of "
            "an outer module, a raw jax transform): its inputs and cotangents cannot leave it, "
            "so its gradients pass through unpreconditioned; create the layer inside the "
            "branch or body function (under the module it receives), which lifts it")
  if any("map_variables(" in p for p in mod.scope.root.debug_path):
    return (f"its variables are mapped by nn.map_variables (nn.WeightNorm, nn.SpectralNorm "
            f"wrap the {type(mod).__name__} so), so the weight it applies is a function of its "
            "parameters, not them; its gradients pass through unpreconditioned")
  return ""


def _trace_discovery(apply: _Apply, record: Callable, ctx: _Context, params: Any,
                     model_state: dict, inputs: Any, extra: Callable[[], list]
                     ) -> tuple[Any, Any]:
  """``(closed jaxpr, (output shapes, mutated params shapes, extra shapes))`` of the discovery
  pass ``model.apply`` under the interceptor ``record``, traced from ``(params, model_state,
  inputs, the call's array keywords)``: the keywords (rngs: an input drawn from them is per
  example) are inputs too. The outputs are the model output's array leaves, the jaxpr's first
  outputs, then the mutated params, then the arrays ``extra()`` gives after the pass (the
  kernels of tied output projections, ``tied_outputs.link``), its last."""
  kw_leaves, kw_def = jax.tree.flatten(apply.kwargs)
  traced = [i for i, v in enumerate(kw_leaves) if isinstance(v, (jax.Array, np.ndarray))]

  def run(p, state, x, kw):
    ctx.trace = jax.extend.core.get_opaque_trace_state(convention="nnx")
    leaves = list(kw_leaves)
    for i, v in zip(traced, kw):
      leaves[i] = v
    with nn.intercept_methods(record):
      out, mutated = dataclasses.replace(apply, kwargs=kw_def.unflatten(leaves)).instrumented(
          {"params": p, **state}, x)
    return ([y for y in jax.tree.leaves(out) if isinstance(y, jax.Array)], mutated["params"],
            extra())

  return jax.make_jaxpr(run, return_shape=True)(params, model_state, inputs,
                                                [kw_leaves[i] for i in traced])


def batch_size(inputs: Any) -> Optional[int]:
  """The leading axis of the first array of rank >= 1 among the model's inputs."""
  return next((x.shape[0] for x in jax.tree.leaves(inputs) if jnp.ndim(x)), None)


def not_per_example(jaxpr: Any, outputs: Any, probes: Mapping[tuple[str, ...], Any],
                    given: int, batch: Optional[int]) -> dict[tuple[str, ...], str]:
  """``{module path: reason}`` of the layers whose input of rank >= 1 depends on none of the
  pass's inputs after its first ``given`` (the parameters and model state): not on the
  examples, nor on the call's keywords (rngs), and whose leading axis is not the ``batch`` of
  the model's input. Such an input (a relative-position bucket table ``(T, T)``, learned
  Perceiver latents ``(L, d)``, position ids ``jnp.arange(T)``) is the same for every example
  and broadcast after the layer, so its rows are not examples and its output cotangents arrive
  summed over the batch: K-FAC's factors cannot be formed from them (the capture would take the
  table's first axis for the examples). One broadcast to ``(N, ...)`` before the layer has a
  row block per example, whose cotangents are that example's: taken. Found from the discovery
  pass's ``jaxpr``, whose outputs are ``outputs`` flattened and hold each layer's recorded input
  ``probes[path]``: by dead-code elimination for a leading axis other than ``N``; for one of
  ``N`` rows (a ``(T, T)`` table at ``N = T`` included, taken for a batched one before), by
  the dependence on the examples propagated forward and whether the leading axis is a
  broadcast (``example_rows.py``).
  """
  index = {id(leaf): i for i, leaf in enumerate(jax.tree.leaves(outputs))}
  dependent = None
  found = {}
  for path, probe in probes.items():
    i = index.get(id(probe))
    if i is None or not probe.shape:
      continue
    if probe.shape[0] == batch:
      var = jaxpr.outvars[i]
      dependent = example_rows.example_dependent(jaxpr, given) if dependent is None else dependent
      per_example = (isinstance(var, jax_core.Literal) or var in dependent
                     or example_rows.broadcast_axis(jaxpr, var, 0))
    else:
      used = _used_inputs(jaxpr, [j == i for j in range(len(jaxpr.outvars))])
      per_example = used is None or any(used[given:])
    if not per_example:
      found[path] = (
          f"applied to an input of shape {tuple(probe.shape)} that depends on no example (a "
          "relative-position bucket table, learned latents, position ids broadcast over the "
          "batch after the layer): its rows are not examples and its output cotangents arrive "
          "summed over the batch, so its gradients pass through unpreconditioned; broadcast "
          "the input to the batch before the layer to have it captured")
  return found


def _module_leaves(params: Any) -> dict[tuple[str, ...], dict]:
  """``{module path: {leaf name: leaf}}`` of a params tree."""
  flat, _ = jax.tree_util.tree_flatten_with_path(params)
  out: dict[tuple[str, ...], dict] = {}
  for path, leaf in flat:
    keys = stats_lib.path_keys(path)
    out.setdefault(keys[:-1], {})[keys[-1]] = leaf
  return out


def _shared_with_apply(apply: _Apply, params: Any, model_state: dict, inputs: Any,
                       foreign: Mapping[str, str], tied: Collection[int] = ()
                       ) -> dict[tuple[str, ...], str]:
  """Modules whose parameters feed a layer applied with ``.apply()`` inside the model (a
  layer fed a model parameter, ``Dense.apply({'params': {'kernel': w}}, x)``): found by
  following the data flow of the traced model from each parameter to those layers'
  variables. ``tied``: the indices of the foreign calls (of registered kinds' ``__call__``)
  that are an embedding's tied output (``_discover``), whose variables are left out."""
  if not foreign:
    return {}
  ctx = _Context({})

  def used(p):
    found = []
    count = [0]  # foreign calls of registered kinds, as _discover counts them

    def grab(next_fun, args, kwargs, context):
      ctx.enter(context.module)
      if ctx.foreign(context.module) and context.method_name == "__call__":
        registered = layers_lib.kind_of_module(context.module) is not None
        count[0] += registered
        if not (registered and count[0] - 1 in tied):
          found.append(context.module.variables.get("params", {}))
      return next_fun(*args, **kwargs)

    with nn.intercept_methods(grab):
      apply.instrumented({"params": p, **model_state}, inputs)
    return found

  closed = jax.make_jaxpr(used)(params)
  needed = _inputs_feeding_outputs(closed.jaxpr)
  flat, _ = jax.tree_util.tree_flatten_with_path(params)
  sites = ", ".join(f"{cls} at {site}" for site, cls in sorted(foreign.items()))
  shared = {}
  for (path, _), var in zip(flat, closed.jaxpr.invars):
    if var in needed:
      keys = stats_lib.path_keys(path)
      shared[keys[:-1]] = (
          f"its parameter {keys[-1]!r} is also used by a layer applied with .apply() inside the "
          f"model ({sites}; e.g. a tied output projection): weight sharing is not "
          "preconditioned yet")
  return shared


def used_outside_their_calls(trace: Callable[[Any], Any], params: Any,
                            modules: Iterable[tuple[str, ...]]) -> dict[tuple[str, ...], str]:
  """Captured modules whose parameters reach the model's outputs other than through the
  module's own calls (a kernel read directly, ``z @ self.enc.variables['params']['kernel'].T``;
  a tied output written ``h @ embed.embedding.T`` rather than ``embed.attend(h)``): their
  gradient then has a part the layer's rows do not give, and their curvature misses that use,
  so they are listed (weight sharing is not preconditioned yet).

  Args:
    trace: ``trace(params) -> outputs``, the model's forward pass in which every call of a
      registered kind's method returns zeros of its output's shape that depend on its inputs
      only (:func:`zeroed_output`: a parameter reaches the outputs through its own calls no
      more, a use upstream of a later layer still does).
    params: the parameter tree.
    modules: the module paths to check (those the capture would take).

  Returns:
    ``{module path: reason}``.

  Found on the traced forward pass by dead-code elimination (``jax``'s own, which follows
  ``scan``, ``remat``, ``jit`` and ``cond`` bodies): at trace time, no FLOPs.
  """
  modules = {tuple(str(k) for k in m): m for m in modules}  # (NNX paths may hold ints)
  if not modules:
    return {}
  closed = traced_outputs(lambda: jax.make_jaxpr(trace)(params))
  used = _used_inputs(closed.jaxpr) or [False] * len(closed.jaxpr.invars)
  flat, _ = jax.tree_util.tree_flatten_with_path(params)
  found = {}
  for (path, _), is_used in zip(flat, used):
    keys = stats_lib.path_keys(path)
    if is_used and keys[:-1] in modules:
      found[modules[keys[:-1]]] = (
          f"its parameter {keys[-1]!r} is also used outside the layer's own calls (read directly, "
          "e.g. a tied output h @ embedding.T: use Embed.attend, or call the layer): weight "
          "sharing is not preconditioned yet")
  return found


def _used_inputs(jaxpr: Any, outputs: Optional[Sequence[bool]] = None) -> Optional[list[bool]]:
  """Which inputs of a jaxpr its outputs (all, or those marked in ``outputs``) depend on,
  through sub-jaxprs too (JAX's dead-code elimination, a private function: where a JAX release
  lacks it, ``None``, and the callers report nothing, as before their checks existed; the
  coarse :func:`_inputs_feeding_outputs` would take every scanned layer for a shared one)."""
  try:
    from jax._src.interpreters import partial_eval  # pylint: disable=import-outside-toplevel
    used = [True] * len(jaxpr.outvars) if outputs is None else list(outputs)
    return list(partial_eval.dce_jaxpr(jaxpr, used)[1])
  except (ImportError, AttributeError, TypeError):  # a JAX without it: no finding
    return None


def zeroed_output(out: Any, inputs: Any = ()) -> Any:
  """Zeros of the shape of a call's output ``out`` that still depend on the call's ``inputs``
  (its arguments): a use of a layer's weights in the forward pass of
  :func:`used_outside_their_calls`, where a parameter must reach the outputs through its
  layer's uses no more, while any other use upstream of a layer (a tied kernel read into a
  later head's input) still does (linen and NNX interceptors, :class:`NotedCalls`)."""
  arrays = [x for x in jax.tree_util.tree_leaves(inputs) if isinstance(x, jax.Array)
            and (jnp.issubdtype(x.dtype, jnp.number) or jnp.issubdtype(x.dtype, jnp.bool_))]
  keep = sum((0 * jnp.sum(x.astype(jnp.float32)) for x in arrays), jnp.float32(0))
  return jax.tree_util.tree_map(lambda o: jnp.zeros_like(o) + keep.astype(o.dtype), out)


class NotedCalls:
  """Which calls of a pass are the uses the discovery pass noted, call by call: each call of a
  method its module's kind intercepts is the next of its path (``noted[path]``, in the order
  the calls begin), and each ``.apply()`` of a registered kind's ``__call__`` inside the model
  the next foreign call (``tied``: those that are an embedding's tied output). Another pass of
  the same model sees the same calls in the same order."""

  def __init__(self, noted: Mapping[Any, tuple[bool, ...]], tied: Mapping[int, Any]):
    self.noted, self.tied = noted, tied
    self.begun: dict = {}
    self.applied = 0

  def use(self, path: Any, mod: Any, method: str) -> bool:
    """Whether this call of ``mod``'s ``method`` (at ``path``) is a noted use (counts it)."""
    kind = layers_lib.kind_of_module(mod)
    if kind is None or not kind.intercepts(mod, method):
      return False
    j = self.begun.get(path, 0)
    self.begun[path] = j + 1
    flags = self.noted.get(path, ())
    return j < len(flags) and flags[j]

  def tied_use(self, mod: Any, method: str) -> Optional[Any]:
    """The path of the embedding whose tied output this foreign call (of a module applied with
    ``.apply()``) is, or ``None`` (counts it)."""
    if method != "__call__" or layers_lib.kind_of_module(mod) is None:
      return None
    self.applied += 1
    return self.tied.get(self.applied - 1)


def _zeroed_calls(noted: NotedCalls) -> Callable:
  """A linen interceptor applying :func:`zeroed_output` to the noted uses (``noted``)."""
  ctx = _Context({})

  def intercept(next_fun, args, kwargs, context):
    mod, method = context.module, context.method_name
    ctx.enter(mod)
    use = (noted.tied_use(mod, method) is not None if ctx.foreign(mod)
           else noted.use(tuple(mod.path), mod, method))
    out = next_fun(*args, **kwargs)
    return zeroed_output(out, (args, kwargs)) if use else out

  return intercept


def _inputs_feeding_outputs(jaxpr: Any) -> set:
  """The input variables of a jaxpr that its outputs depend on (an equation's outputs are taken
  to depend on all of its inputs)."""
  live = {v for v in jaxpr.outvars if not isinstance(v, jax_core.Literal)}
  for eqn in reversed(jaxpr.eqns):
    if any(v in live for v in eqn.outvars):
      live.update(v for v in eqn.invars if not isinstance(v, jax_core.Literal))
  return live


def _normalized_input(kind: layer_base.LayerKind, meta: dict, mod: nn.Module, args: tuple,
                      kwargs: dict, state: dict, dtype: jnp.dtype) -> jax.Array:
  """``x_hat`` of a normalization layer: an unbound clone without scale and bias (the kind's
  ``unit_affine`` given the layer's plan ``meta``), applied to the same arguments with the
  layer's collections as it read them."""
  plain = kind.unit_affine(mod, dtype, meta)
  x_hat, _ = plain.apply(state, *args, mutable=True, **kwargs)
  return jax.lax.stop_gradient(x_hat)


def _with_channels(params: Any, perts: Mapping[tuple[str, ...], Any]) -> Any:
  """``params`` with each captured layer's zero perturbation beside its leaves (for a layer
  shared over a loop's iterations, its three ``StepChannels``)."""
  if not perts:
    return params
  tree = dict(params)
  for path, zeros in perts.items():
    node = tree
    for key in path:
      node[key] = dict(node[key])
      node = node[key]
    if isinstance(zeros, step_sharing.StepChannels):
      node[_STEP_INPUTS], node[_STEPS] = zeros.inputs, zeros.steps
      zeros = zeros.cotangents
    node[_PERTURBATION] = zeros
  return tree


def _forward(apply: _Apply, model_state: dict, inputs: Any,
             normalized: Mapping[tuple[str, ...], tuple[layer_base.LayerKind, dict]],
             shared: Mapping[tuple[str, ...], tuple[bool, ...]],
             tied: Mapping[int, tuple[str, ...]], params: Any,
             perts: dict) -> tuple[Any, tuple[dict, Any]]:
  """The forward pass that records captured layers' inputs and perturbs their outputs.

  Both go through each layer's own ``params`` scope (its perturbation is read from
  ``_PERTURBATION`` beside its parameters and its input written to ``_INPUTS``), so they pass
  through linen's lifted transforms as its parameters do: sliced and stacked by ``nn.scan``,
  rematerialized by ``nn.remat``. A layer with several uses (``shared[path]``: for each call of
  a method its kind intercepts, in the order the calls begin, whether the discovery pass took
  it for a use, ``_discover``; ``perts[path]`` a tuple, one per use; only layers called
  directly) is handled in this trace: its ``i``-th use adds the ``i``-th perturbation and the
  uses' inputs come back as a tuple. A layer shared over a loop's iterations (``perts[path]`` a
  ``step_sharing.StepChannels``) reads its channels, loop invariants, from its ``params`` scope
  and attaches them to every iteration's output (``step_sharing.tap``); it records nothing.
  The ``k``-th foreign call of a registered kind's ``__call__`` (a layer applied with
  ``.apply()``) with ``k`` in ``tied`` is a use of the embedding ``tied[k]``, in this order
  among its uses (its tied output, ``tied_outputs.py``).
  """
  ctx = _Context({})
  uses = NotedCalls(shared, tied)
  steps = {p for p, z in perts.items() if isinstance(z, step_sharing.StepChannels)}
  in_clone = [False]  # the x_hat clone's own call passes through the interceptor
  used: dict[tuple[str, ...], list] = {p: [] for p in shared}

  def intercept(next_fun, args, kwargs, context):
    mod = context.module
    ctx.enter(mod)
    path = tuple(mod.path)
    if not in_clone[0]:  # a use of a shared layer: its own, or an embedding's tied output
      use = (uses.tied_use(mod, context.method_name) if ctx.foreign(mod)
             else path if path in used and uses.use(path, mod, context.method_name) else None)
      if use in used:
        used[use].append(primary_input(args, kwargs))
        return next_fun(*args, **kwargs) + perts[use][len(used[use]) - 1]
    if (in_clone[0] or context.method_name != "__call__" or path not in perts
        or ctx.foreign(mod)):
      return next_fun(*args, **kwargs)
    if path in steps:
      ch = step_sharing.StepChannels(*(mod.scope.get_variable("params", name)
                                       for name in (_STEP_INPUTS, _PERTURBATION, _STEPS)))
      return step_sharing.tap(next_fun(*args, **kwargs), primary_input(args, kwargs), ch)
    if path not in normalized:
      mod.scope.put_variable("params", _INPUTS, primary_input(args, kwargs))
      return next_fun(*args, **kwargs) + mod.scope.get_variable("params", _PERTURBATION)
    # Non-parameter collections (batch_stats) as the layer sees them, before it updates them:
    # copied containers (mod.variables are views the layer's call writes through).
    state = jax.tree_util.tree_map(
        lambda v: v, {col: v for col, v in mod.variables.items() if col != "params"})
    out = next_fun(*args, **kwargs)
    in_clone[0] = True
    try:
      x_hat = _normalized_input(*normalized[path], mod, args, kwargs, state, out.dtype)
    finally:
      in_clone[0] = False
    mod.scope.put_variable("params", _INPUTS, x_hat)
    return out + mod.scope.get_variable("params", _PERTURBATION)

  channels = {p: z for p, z in perts.items() if p not in used}
  variables = {"params": _with_channels(params, channels), **model_state}
  with nn.intercept_methods(intercept):
    outputs, mutated = apply.instrumented(variables, inputs)
  layer_inputs = {path: _get(mutated["params"], path)[_INPUTS] for path in channels
                  if path not in steps}
  layer_inputs.update({path: tuple(xs) for path, xs in used.items()})
  return outputs, (layer_inputs, apply.user_state(mutated))


def value_and_grad_with_stats(
    model: nn.Module,
    loss_fn: Callable[[jax.Array, Any], jax.Array],
    *,
    fisher_type: str = "empirical",
    likelihood: Optional[str] = None,
    num_samples: int = 1,
    loss_reduction: str = "mean",
    num_loss_terms: Optional[int] = None,
    weight_sharing: str = "auto",
) -> Callable[..., Any]:
  """Loss, gradients and per-layer curvature statistics in one forward and one backward pass.

  Args:
    model: a Flax linen module, unchanged.
    loss_fn: ``loss_fn(outputs, targets) -> scalar`` on the model's outputs.
    fisher_type: ``'empirical'`` (default; gradients of the training loss), ``'sampled'``
      (targets drawn from the model, needs ``likelihood`` and an ``rng``) or ``'exact'``
      (all ``K`` output directions; small models only).
    likelihood: ``'softmax_cross_entropy'`` or ``'squared_error'``, the predictive
      distribution for the sampled and exact Fisher.
    num_samples: targets drawn per example for ``'sampled'``.
    loss_reduction: ``'mean'`` if ``loss_fn`` averages over loss terms (examples, or positions),
      ``'sum'`` if it sums them. The factors are those of the mean of the terms either way, so
      a summed loss's step is ``M`` times a mean loss's, as with SGD (README, Conventions).
    num_loss_terms: how many terms the loss averages (or sums): ``N`` for a loss over the
      examples (a classifier, a per-sequence loss such as CTC), ``N * T`` for one averaged over
      every position (a language model). ``None`` (default) reads it from the output's leading
      axes, which needs the model to return one array of rank >= 2 (``(N, K)`` -> ``N``,
      ``(N, T, K)`` -> ``N * T``); a model returning a tuple, dict or dataclass, or a rank-1
      array (``Dense(1)(x)[..., 0]``), must state it. Under ``jax.pmap`` the count is the
      replica's own (its shard's ``N``), not the global batch's.
    weight_sharing: how a dense layer applied at every position of a sequence (its weights
      shared over the positions) folds them into its factors (Eschenhagen et al., NeurIPS
      2023): ``'expand'`` (every position a row, ``A = (1/M) sum_{n,t} a a^T`` for ``M`` loss
      terms; exact for a loss per position, language modelling), ``'reduce'`` (per example,
      inputs averaged and cotangents summed over positions: ``N`` rows, about ``T`` times
      cheaper; exact when positions are pooled before a per-example loss, a classifying
      ViT), or ``'auto'`` (default): expand when the loss has more terms than examples, else
      reduce, except for the key projections of attention, always expanded (their
      cotangents sum to zero over the positions: reduce's ``G`` would vanish), found from
      the traced model, Flax's attention modules and attention written by hand alike
      (``attention_keys.py``). Dense and ``DenseGeneral`` layers; embeddings always expand,
      convolutions follow the transforms' ``conv_statistics``. A layer whose weights a lifted
      loop applies at every iteration (a recurrent cell) is always folded with reduce over the
      iterations, whose rows do not leave the loop; ``'expand'`` lists it with that reason.

  Returns:
    ``fn(params, inputs, targets, /, *, rng=None, model_state=None, mutable=False,
    **apply_kwargs)``, which calls ``model.apply({"params": params, **model_state}, inputs,
    mutable=mutable, **apply_kwargs)`` once (its first three arguments positional only, so that
    a model's own ``targets`` keyword, Flax's WMT ``Transformer(inputs, targets)``, goes to the
    model) and returns ``((loss, grads), stats)``, or
    ``((loss, grads), stats, mutated)`` when ``mutable`` is not ``False`` or
    ``capture_intermediates`` is set (as ``Module.apply``), where:

    * ``grads`` mirrors ``params``;
    * ``stats`` is a :class:`CurvatureStats` whose ``layers`` mirror ``params`` at every
      captured layer: :class:`DenseStats` (inputs ``(N, ..., d_in)``, cotangents
      ``(S, N, ..., d_out)``), :class:`ConvStats` (inputs ``(N, spatial..., C)``),
      :class:`EmbedStats` (ids ``(N, ...)``, cotangents ``(S, N, ..., features)``) or
      :class:`NormStats` (``(S, N, C)`` scale and bias gradients per loss term). Cotangents are
      per example: ``N`` times those of a mean loss (``N`` = number of loss terms). Its
      ``unhandled`` lists modules with parameters that were not captured (shared layers,
      tied embeddings, normalization over other than the last axis, unsupported kinds); their
      gradients pass through the transforms unchanged;
    * ``mutated`` is the dict of updated collections exactly as ``model.apply(...,
      mutable=mutable)`` returns it (e.g. ``{"batch_stats": ...}`` for a training-mode
      BatchNorm).

    ``model_state`` holds the model's other variable collections (e.g.
    ``{"batch_stats": ...}``); ``mutable`` is ``Module.apply``'s (``False``, a collection name or
    a list of names). Under ``jax.jit`` bind ``mutable`` with ``functools.partial`` (or make it
    a static argument of a hashable value): it is not an array. ``apply_kwargs`` go to
    ``model.apply`` (e.g. ``rngs=`` for dropout).

  Raises:
    ValueError: on an unknown ``fisher_type``, ``likelihood``, ``loss_reduction`` or
      ``weight_sharing``, a sampled or exact Fisher without a ``likelihood``,
      ``num_samples < 1`` or a bad ``num_loss_terms``; from ``fn``, for a sampled Fisher called
      without ``rng``, a ``model_state`` holding ``"params"``, outputs whose number of loss
      terms cannot be read from their shape (see ``num_loss_terms``), or a sampled or exact
      Fisher of a model that does not return one array; from ``fn``, an ``rng`` given to a
      model whose ``__call__`` takes an ``rng`` of its own (which the capture's would hide).
    TypeError: if ``model`` is not a linen module (an NNX model: use
      ``thor_optax.nnx.value_and_grad_with_stats``) or ``loss_fn`` is not callable.
  """
  if not isinstance(model, nn.Module):
    raise TypeError(
        f"thor_optax.flax.value_and_grad_with_stats needs a flax.linen Module, got "
        f"{type(model).__name__}"
        + ("; for an NNX model use thor_optax.nnx.value_and_grad_with_stats(loss_fn)(model, x, "
           "y)." if isinstance(model, nnx.Module) else "."))
  if not callable(loss_fn) or isinstance(loss_fn, nn.Module):
    raise TypeError(f"thor_optax.flax.value_and_grad_with_stats: loss_fn must be a function "
                    f"loss_fn(outputs, targets) -> scalar, got {type(loss_fn).__name__}.")
  options = FisherOptions(fisher_type, likelihood, num_samples, loss_reduction, num_loss_terms,
                          weight_sharing)

  def fn(params, inputs, targets, /, *, rng=None, model_state: Optional[Mapping] = None,
         mutable: Union[bool, str, Sequence[str]] = False, **apply_kwargs):
    options.check_rng(rng)
    check_rng_keyword(type(model).__call__, rng, "thor_optax.flax.value_and_grad_with_stats")
    model_state = dict(model_state or {})
    if "params" in model_state:
      raise ValueError("model_state holds the non-parameter collections; pass params "
                       "as the first argument.")
    apply = _Apply(model, mutable, apply_kwargs)
    calls, counts, foreign, transformed, keys, tied, noted = one_input(
        lambda: _discover(apply, params, model_state, inputs),
        "thor_optax.flax.value_and_grad_with_stats")
    shared = {**_shared_with_apply(apply, params, model_state, inputs, foreign, set(tied)),
              **transformed}

    def zeroed(p):
      with nn.intercept_methods(_zeroed_calls(NotedCalls(noted, tied))):
        return apply.outputs({"params": p, **model_state}, inputs)

    shared.update(used_outside_their_calls(zeroed, params, set(calls) - set(shared)))
    reasons = unsupported_reasons(stats_lib.path_keys(path) for path, _ in
                                  jax.tree_util.tree_flatten_with_path(params)[0])
    if isinstance(model, nnx_bridge.ToLinen):  # (one deeper in a linen model: the generic reason)
      reasons = bridged_reasons(reasons, [()], "NNX")
    captured, unhandled = plan_calls(calls, reasons, counts, shared, weight_sharing, keys)
    forward = functools.partial(
        _forward, apply, model_state, inputs,
        {p: (c["kind"], c["meta"]) for p, c in captured.items() if c["kind"].normalized_input},
        {p: noted[p] for p, c in captured.items() if c["uses"] and p in noted}, tied)
    loss, grads, stats, mutated = vjp_with_stats(forward, params, captured, unhandled, loss_fn,
                                                 targets, rng, options)
    if not apply.returns_state:
      return (loss, grads), stats
    return (loss, grads), stats, mutated

  return fn
