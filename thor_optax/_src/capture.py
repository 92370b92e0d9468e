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

Captured layer kinds (a single call per forward pass each; see ``layers/*.py``):

* ``nn.Dense`` -> ``DenseStats`` (input, output cotangents);
* ``nn.Conv`` (2-D, one feature group, unmasked) -> ``ConvStats``;
* ``nn.Embed`` (``__call__`` only; a module whose ``attend`` runs, e.g. tied input/output
  embeddings, is shared and left alone) -> ``EmbedStats`` (token ids, output cotangents);
* ``nn.BatchNorm`` and ``nn.LayerNorm`` with scale and/or bias over the last axis only ->
  ``NormStats`` (per-example scale and bias gradients);
* modules of kinds registered with ``thor_optax.register_layer_kind``.

For a normalization layer (a kind with ``normalized_input``) the interceptor also needs ``x_hat``, the normalized input before
scale and bias. It is recomputed by applying an unbound clone of the module with
``use_scale=False, use_bias=False`` (and the layer's output dtype) to the same arguments, with
the layer's non-parameter collections (``batch_stats``) as read before the layer runs and
``mutable=True`` so that a training-mode BatchNorm may update its (discarded) copy of the running
statistics. The clone's statistics are the layer's own (the batch's, or the running averages),
and ``x_hat`` is never formed as ``(y - bias) / scale``, which fails for a zero scale (zero-init
residual BatchNorm). Model parameters, ``batch_stats`` and the model's outputs are untouched.

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
import math
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import flax.linen as nn
import jax
import jax.numpy as jnp

from thor_optax._src import layers as layers_lib
from thor_optax._src import stats as stats_lib
from thor_optax._src.layers import base as layer_base

FISHER_TYPES = ("empirical", "sampled", "exact")
LIKELIHOODS = ("softmax_cross_entropy", "squared_error")


def primary_input(args: tuple, kwargs: dict) -> Any:
  """The first argument of a layer's ``__call__`` (``inputs`` / ``x``), positional or not."""
  if args:
    return args[0]
  for key in ("inputs", "x", "query"):
    if key in kwargs:
      return kwargs[key]
  raise ValueError(f"cannot find the input among keyword arguments {sorted(kwargs)}")


def _set_nested(tree: dict, path: tuple[Any, ...], value: Any) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def _module_paths(params: Any) -> set[tuple[str, ...]]:
  flat, _ = jax.tree_util.tree_flatten_with_path(params)
  return {stats_lib.path_keys(path)[:-1] for path, _ in flat}


def output_cotangents(outputs: jax.Array, dloss: jax.Array, n_examples: int, fisher_type: str,
                      likelihood: Optional[str], num_samples: int,
                      rng: Optional[jax.Array]) -> jax.Array:
  """Per-example cotangents at the model output, ``(S, *outputs.shape)``.

  ``G`` is formed as the sum over ``S`` of the per-example cotangent covariance, so every
  variant below is scaled to make that sum the intended Fisher factor.

  Args:
    outputs: model outputs, ``(N, ..., K)``.
    dloss: gradient of the (mean) training loss w.r.t. ``outputs``.
    n_examples: number of terms the loss averages (``dloss * n_examples`` is per example).
    fisher_type: ``'empirical'``, ``'sampled'`` or ``'exact'``.
    likelihood: ``'softmax_cross_entropy'`` or ``'squared_error'`` (``0.5 ||y - f||^2`` per
      example) for the sampled and exact types.
    num_samples: ``S`` for ``'sampled'``.
    rng: PRNG key for ``'sampled'``.

  Returns:
    ``(S, *outputs.shape)`` cotangents (``S = 1`` empirical, ``num_samples`` sampled, ``K``
    exact).
  """
  if fisher_type == "empirical":
    return (dloss * n_examples)[None]
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


@dataclasses.dataclass(frozen=True)
class FisherOptions:
  """The Fisher options of a capture, validated on construction.

  Attributes:
    fisher_type: ``'empirical'``, ``'sampled'`` or ``'exact'``.
    likelihood: ``'softmax_cross_entropy'``, ``'squared_error'`` or ``None`` (empirical only).
    num_samples: targets drawn per example for ``'sampled'`` (``>= 1``).
    loss_reduction: ``'mean'`` or ``'sum'``.

  Raises:
    ValueError: on an unknown ``fisher_type``, ``likelihood`` or ``loss_reduction``, a sampled
      or exact Fisher without a ``likelihood``, or ``num_samples < 1``.
  """

  fisher_type: str = "empirical"
  likelihood: Optional[str] = None
  num_samples: int = 1
  loss_reduction: str = "mean"

  def __post_init__(self):
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

  def check_rng(self, rng: Optional[jax.Array]) -> None:
    """Raises ``ValueError`` if the Fisher type draws targets and ``rng`` is ``None``."""
    if self.fisher_type == "sampled" and rng is None:
      raise ValueError(
          "fisher_type='sampled' draws targets from the model: pass rng=<PRNGKey>.")


def note_call(calls: dict, path: tuple[Any, ...], mod: Any, method: str, args: tuple,
              kwargs: dict, out: jax.Array) -> None:
  """Records one call of a captured module's method for :func:`plan_calls` (an abstract pass).

  Appends ``(module, method, input shape, output ShapeDtypeStruct)`` to ``calls[path]``.
  """
  calls.setdefault(path, []).append(
      (mod, method, primary_input(args, kwargs).shape,
       jax.ShapeDtypeStruct(out.shape, out.dtype)))


def path_name(path: tuple[Any, ...]) -> str:
  """``('Block_0', 'Dense_1')`` -> ``'Block_0/Dense_1'`` (integer keys as digits), the layer names
  the transforms use (``'/'.join(stats.path_keys(...))``)."""
  return "/".join(str(k) for k in path)


def plan_calls(calls: Mapping[tuple[Any, ...], list],
               module_reasons: Mapping[tuple[Any, ...], str]) -> tuple[dict, dict]:
  """Which module calls are captured, and why the others are not.

  Args:
    calls: ``{module path: [(module, method, input shape, output ShapeDtypeStruct), ...]}``,
      one entry per call of an intercepted method of a registered layer kind's module in one
      forward pass, as :func:`note_call` records them.
    module_reasons: ``{module path: reason}`` for every module holding parameters: the reason it
      is listed as unhandled if no captured call was seen for it (e.g. ``'module kind not
      supported'``).

  Returns:
    ``(captured, unhandled)``: ``captured[path] = dict(kind=, meta=, out=)`` with ``kind`` the
    module's ``LayerKind``, ``meta`` the static metadata of its statistics and ``out`` the
    output's ``ShapeDtypeStruct``; ``unhandled[path] = reason``.
  """
  unhandled: dict[tuple[Any, ...], str] = {}
  captured: dict[tuple[Any, ...], dict] = {}
  for path, seen in calls.items():
    mod, _, in_shape, out = seen[0]
    kind = layers_lib.kind_of_module(mod)
    plan = kind.plan(mod, tuple(method for _, method, _, _ in seen), in_shape)
    if plan.meta is None and not plan.reason:
      continue  # no parameters, nothing to precondition
    n_calls = sum(method == "__call__" for _, method, _, _ in seen)
    if n_calls > 1:
      plan = layer_base.Plan(None, f"called {n_calls} times per forward pass (shared layer)")
    if plan.meta is None:
      unhandled[path] = plan.reason
      continue
    captured[path] = dict(kind=kind, meta=plan.meta, out=out)
  for path, reason in module_reasons.items():
    if path not in captured and path not in unhandled:
      unhandled[path] = reason
  return captured, unhandled


def _curvature_stats(captured: Mapping[tuple[Any, ...], dict],
                     unhandled: Mapping[tuple[Any, ...], str],
                     layer_inputs: Mapping[tuple[Any, ...], jax.Array],
                     cts: Mapping[tuple[Any, ...], jax.Array]) -> stats_lib.CurvatureStats:
  """Each captured layer's statistics, built by its kind from the recorded inputs (``x_hat``
  for normalization layers) and the per-example output cotangents."""
  layers: dict = {}
  for path, c in captured.items():
    _set_nested(layers, path, c["kind"].make_stats(layer_inputs[path], cts[path], **c["meta"]))
  notes = tuple(f"{path_name(p)}: {why}"
                for p, why in sorted(unhandled.items(), key=lambda kv: path_name(kv[0])))
  return stats_lib.CurvatureStats(layers=layers, unhandled=notes)


def vjp_with_stats(
    forward: Callable[[Any, dict], tuple[jax.Array, tuple[dict, Any]]],
    params: Any,
    captured: Mapping[tuple[Any, ...], dict],
    unhandled: Mapping[tuple[Any, ...], str],
    loss_fn: Callable[[jax.Array, Any], jax.Array],
    targets: Any,
    rng: Optional[jax.Array],
    options: FisherOptions,
) -> tuple[jax.Array, Any, stats_lib.CurvatureStats, Any]:
  """Loss, gradients and statistics from one ``jax.vjp`` of an instrumented forward pass.

  Args:
    forward: ``forward(params, perturbations) -> (outputs, (layer_inputs, aux))``: the model's
      forward pass that adds ``perturbations[path]`` (zeros of the layer's output shape) to the
      output of every captured layer and records its input (``x_hat`` for a normalization layer)
      in ``layer_inputs[path]``; ``aux`` is passed through (e.g. updated model state).
    params: the differentiated parameters (any pytree).
    captured, unhandled: from :func:`plan_calls`.
    loss_fn: ``loss_fn(outputs, targets) -> scalar``.
    targets: second argument of ``loss_fn``.
    rng: PRNG key for ``'sampled'``.
    options: the Fisher options.

  Returns:
    ``(loss, grads, stats, aux)``; ``grads`` has the structure of ``params``; ``stats`` is a
    :class:`CurvatureStats` whose layers nest by the keys of each captured path.
  """
  perturbations = {path: jnp.zeros(c["out"].shape, c["out"].dtype)
                   for path, c in captured.items()}
  outputs, vjp_fn, (layer_inputs, aux) = jax.vjp(forward, params, perturbations, has_aux=True)
  loss, dloss = jax.value_and_grad(loss_fn)(outputs, targets)
  grads, layer_cts = vjp_fn(dloss.astype(outputs.dtype))
  n_examples = math.prod(outputs.shape[:-1]) if options.loss_reduction == "mean" else 1
  if options.fisher_type == "empirical":
    cts = jax.tree_util.tree_map(lambda c: (c * n_examples)[None], layer_cts)
  else:
    out_cts = output_cotangents(outputs, dloss, n_examples, options.fisher_type,
                                options.likelihood, options.num_samples, rng)
    cts = jax.vmap(lambda ct: vjp_fn(ct)[1])(out_cts)
  return loss, grads, _curvature_stats(captured, unhandled, layer_inputs, cts), aux


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

  def __call__(self, variables: dict, inputs: Any) -> tuple[Any, Any]:
    if not self.returns_state:
      return self.model.apply(variables, inputs, **self.kwargs), None
    return self.model.apply(variables, inputs, mutable=self.mutable, **self.kwargs)


def _discover(apply: _Apply, params: Any, model_state: dict, inputs: Any) -> dict:
  """Calls, shapes and metadata of every registered kind's module (an abstract pass, no FLOPs)."""
  calls: dict[tuple[str, ...], list] = {}

  def record(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    mod, method = context.module, context.method_name
    kind = layers_lib.kind_of_module(mod)
    if kind is not None and method in kind.methods:
      note_call(calls, mod.path, mod, method, args, kwargs, out)
    return out

  def run(p, state, x):
    with nn.intercept_methods(record):
      return apply({"params": p, **state}, x)

  jax.eval_shape(run, params, model_state, inputs)
  return calls


def _normalized_input(mod: nn.Module, args: tuple, kwargs: dict, state: dict,
                      dtype: jnp.dtype) -> jax.Array:
  """``x_hat`` of a normalization layer: an unbound clone without scale and bias, applied to
  the same arguments with the layer's collections as it read them."""
  plain = mod.clone(parent=None, use_scale=False, use_bias=False, dtype=dtype)
  x_hat, _ = plain.apply(state, *args, mutable=True, **kwargs)
  return jax.lax.stop_gradient(x_hat)


def _forward(apply: _Apply, model_state: dict, inputs: Any, normalized: set, params: Any,
             perts: dict) -> tuple[Any, tuple[dict, Any]]:
  """The forward pass that records captured layers' inputs and perturbs their outputs."""
  layer_inputs = {}
  in_clone = [False]  # the x_hat clone's own call passes through the interceptor

  def intercept(next_fun, args, kwargs, context):
    path, mod = context.module.path, context.module
    if in_clone[0] or context.method_name != "__call__" or path not in perts:
      return next_fun(*args, **kwargs)
    if path not in normalized:
      layer_inputs[path] = primary_input(args, kwargs)
      return next_fun(*args, **kwargs) + perts[path]
    # Non-parameter collections (batch_stats) as the layer sees them, before it updates them.
    state = {col: v for col, v in mod.variables.items() if col != "params"}
    out = next_fun(*args, **kwargs)
    in_clone[0] = True
    try:
      layer_inputs[path] = _normalized_input(mod, args, kwargs, state, out.dtype)
    finally:
      in_clone[0] = False
    return out + perts[path]

  with nn.intercept_methods(intercept):
    outputs, mutated = apply({"params": params, **model_state}, inputs)
  return outputs, (layer_inputs, mutated)


def value_and_grad_with_stats(
    model: nn.Module,
    loss_fn: Callable[[jax.Array, Any], jax.Array],
    *,
    fisher_type: str = "empirical",
    likelihood: Optional[str] = None,
    num_samples: int = 1,
    loss_reduction: str = "mean",
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
    loss_reduction: ``'mean'`` if ``loss_fn`` averages over all leading axes of the outputs
      (``N`` examples, or ``N * T`` positions), ``'sum'`` if it sums.

  Returns:
    ``fn(params, inputs, targets, *, rng=None, model_state=None, mutable=False,
    **apply_kwargs)``, which calls ``model.apply({"params": params, **model_state}, inputs,
    mutable=mutable, **apply_kwargs)`` once and returns ``((loss, grads), stats)``, or
    ``((loss, grads), stats, mutated)`` when ``mutable`` is not ``False`` or
    ``capture_intermediates`` is set (as ``Module.apply``), where:

    * ``grads`` mirrors ``params``;
    * ``stats`` is a :class:`CurvatureStats` whose ``layers`` mirror ``params`` at every
      captured layer: :class:`DenseStats` (inputs ``(N, ..., d_in)``, cotangents
      ``(S, N, ..., d_out)``), :class:`ConvStats` (inputs ``(N, H, W, C)``),
      :class:`EmbedStats` (ids ``(N, ...)``, cotangents ``(S, N, ..., features)``) or
      :class:`NormStats` (``(S, N, C)`` per-example scale and bias gradients). Cotangents are
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
    ValueError: on an unknown ``fisher_type``, ``likelihood`` or ``loss_reduction``, a sampled
      or exact Fisher without a ``likelihood``, or ``num_samples < 1``; from ``fn``, for a
      sampled Fisher called without ``rng`` or a ``model_state`` holding ``"params"``.
  """
  options = FisherOptions(fisher_type, likelihood, num_samples, loss_reduction)

  def fn(params, inputs, targets, *, rng=None, model_state: Optional[Mapping] = None,
         mutable: Union[bool, str, Sequence[str]] = False, **apply_kwargs):
    options.check_rng(rng)
    model_state = dict(model_state or {})
    if "params" in model_state:
      raise ValueError("model_state holds the non-parameter collections; pass params "
                       "as the first argument.")
    apply = _Apply(model, mutable, apply_kwargs)
    calls = _discover(apply, params, model_state, inputs)
    captured, unhandled = plan_calls(
        calls, {path: "module kind not supported" for path in _module_paths(params)})
    forward = functools.partial(_forward, apply, model_state, inputs,
                                {p for p, c in captured.items() if c["kind"].normalized_input})
    loss, grads, stats, mutated = vjp_with_stats(forward, params, captured, unhandled, loss_fn,
                                                 targets, rng, options)
    if not apply.returns_state:
      return (loss, grads), stats
    return (loss, grads), stats, mutated

  return fn
