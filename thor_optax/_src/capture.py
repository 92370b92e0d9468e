"""Capture of curvature statistics from an unchanged Flax linen model.

``value_and_grad_with_stats(model, loss_fn)`` returns a function that, in one forward and one
backward pass, gives the loss, the parameter gradients and the curvature statistics of every
captured layer. It wraps ``model.apply`` in ``flax.linen.intercept_methods``: each captured
layer's input is recorded and a zero perturbation is added to its output, so the cotangent of
that perturbation, returned by the same ``jax.vjp`` that gives the parameter gradients, is the
layer's output cotangent.

What does not depend on how calls are intercepted is shared with the Flax NNX capture
(``nnx_capture.py``): the captured classes by kind (:class:`LayerKinds`), which calls are
captured and why others are not (:func:`plan_calls`), the Fisher options
(:class:`FisherOptions`) and the ``vjp`` that turns recorded inputs and output cotangents into
statistics (:func:`vjp_with_stats`).

Captured layer kinds (a single call per forward pass each):

* ``nn.Dense`` -> :class:`DenseStats` (input, output cotangents);
* ``nn.Conv`` (2-D, one feature group, unmasked) -> :class:`ConvStats`;
* ``nn.Embed`` (``__call__`` only; a module whose ``attend`` runs, e.g. tied input/output
  embeddings, is shared and left alone) -> :class:`EmbedStats` (token ids, output cotangents);
* ``nn.BatchNorm`` and ``nn.LayerNorm`` with scale and/or bias over the last axis only ->
  :class:`NormStats` (per-example scale and bias gradients).

For a normalization layer the interceptor also needs ``x_hat``, the normalized input before
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
import math
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import flax.linen as nn
import jax
import jax.numpy as jnp

from thor_optax._src import stats as stats_lib

FISHER_TYPES = ("empirical", "sampled", "exact")
LIKELIHOODS = ("softmax_cross_entropy", "squared_error")


def _pair(x: Any, default: int = 1) -> Optional[tuple[int, ...]]:
  if x is None:
    return (default, default)
  if isinstance(x, int):
    return (x, x)
  return tuple(int(v) for v in x)


def _conv_metadata(mod: Any) -> tuple[Optional[dict], str]:
  """Static conv metadata for :class:`ConvStats`, or ``(None, reason)`` if unsupported."""
  kernel_size = mod.kernel_size
  kernel_size = (kernel_size,) if isinstance(kernel_size, int) else tuple(kernel_size)
  if len(kernel_size) != 2:
    return None, f"{len(kernel_size)}-D convolution (only 2-D is supported)"
  if mod.feature_group_count != 1:
    return None, f"feature_group_count={mod.feature_group_count} (only 1 is supported)"
  if getattr(mod, "mask", None) is not None:
    return None, "masked convolution"
  padding = mod.padding
  if isinstance(padding, str):
    if padding.upper() not in ("SAME", "VALID"):
      return None, f"padding={padding!r} (SAME, VALID or explicit pads are supported)"
    padding = padding.upper()
  elif isinstance(padding, int):
    padding = ((padding, padding),) * 2
  else:
    padding = tuple((p, p) if isinstance(p, int) else (int(p[0]), int(p[1])) for p in padding)
  return dict(
      kernel_size=tuple(int(k) for k in kernel_size),
      strides=_pair(mod.strides),
      padding=padding,
      input_dilation=_pair(mod.input_dilation),
      kernel_dilation=_pair(mod.kernel_dilation),
  ), ""


@dataclasses.dataclass(frozen=True)
class LayerKinds:
  """The module classes of one Flax API that are captured, by kind.

  The linen and NNX captures share the planning (:func:`plan_calls`) and the statistics
  (:func:`vjp_with_stats`); only these classes and the way calls are intercepted differ. The
  classes must have the attributes of their linen counterparts that the planning reads
  (``kernel_size``, ``strides``, ``padding``, ``input_dilation``, ``kernel_dilation``,
  ``feature_group_count``, ``mask`` for convolutions; ``use_scale``, ``use_bias`` and ``axis``
  (BatchNorm) or ``feature_axes`` (LayerNorm) for normalization layers), as ``flax.nnx``'s do.
  """

  dense: tuple[type, ...]
  conv: tuple[type, ...]
  embed: tuple[type, ...]
  batch_norm: tuple[type, ...]
  layer_norm: tuple[type, ...]

  @property
  def norms(self) -> tuple[type, ...]:
    return self.batch_norm + self.layer_norm

  @property
  def captured(self) -> tuple[type, ...]:
    return self.dense + self.conv + self.embed + self.norms


LINEN_KINDS = LayerKinds(dense=(nn.Dense,), conv=(nn.Conv,), embed=(nn.Embed,),
                         batch_norm=(nn.BatchNorm,), layer_norm=(nn.LayerNorm,))


def _canonical_axes(axes: Any, ndim: int) -> tuple[int, ...]:
  axes = (axes,) if isinstance(axes, int) else tuple(axes)
  return tuple(sorted({int(a) % ndim for a in axes}))


def _norm_reason(mod: Any, in_shape: tuple[int, ...], kinds: LayerKinds) -> str:
  """Why a BatchNorm/LayerNorm call cannot be captured (``''`` if it can)."""
  ndim = len(in_shape)
  if ndim < 2:
    return f"normalization input of shape {in_shape} has no batch axis"
  if isinstance(mod, kinds.batch_norm):
    feature_axes = _canonical_axes(mod.axis, ndim)
    name = "axis"
  else:
    feature_axes = _canonical_axes(mod.feature_axes, ndim)
    name = "feature_axes"
  if feature_axes != (ndim - 1,):
    return (f"{name}={feature_axes} on a rank-{ndim} input: only scale and bias over the last "
            "axis are supported")
  return ""


def primary_input(args: tuple, kwargs: dict) -> Any:
  """The first argument of a layer's ``__call__`` (``inputs`` / ``x``), positional or not."""
  if args:
    return args[0]
  for key in ("inputs", "x", "query"):
    if key in kwargs:
      return kwargs[key]
  raise ValueError(f"cannot find the input among keyword arguments {sorted(kwargs)}")


def _norm_stats(x_hat: jax.Array, g: jax.Array, has_scale: bool,
                has_bias: bool) -> stats_lib.NormStats:
  """Per-example scale and bias gradients from ``x_hat (N, ..., C)`` and ``g (S, N, ..., C)``."""
  dtype = jnp.promote_types(x_hat.dtype, g.dtype)
  g = g.astype(dtype)
  positions = tuple(range(2, g.ndim - 1))
  zeros = jnp.zeros(g.shape[:2] + g.shape[-1:], dtype)
  scale_grads = (x_hat.astype(dtype)[None] * g).sum(positions) if has_scale else zeros
  bias_grads = g.sum(positions) if has_bias else zeros
  return stats_lib.NormStats(scale_grads=scale_grads, bias_grads=bias_grads)


def _set_nested(tree: dict, path: tuple[Any, ...], value: Any) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def _module_paths(params: Any) -> set[tuple[str, ...]]:
  flat, _ = jax.tree_util.tree_flatten_with_path(params)
  return {stats_lib.path_keys(path[:-1]) for path, _ in flat}


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


def plan_calls(calls: Mapping[tuple[Any, ...], list], module_reasons: Mapping[tuple[Any, ...], str],
               kinds: LayerKinds) -> tuple[dict, dict]:
  """Which module calls are captured, and why the others are not.

  Args:
    calls: ``{module path: [(module, method, input shape, output ShapeDtypeStruct), ...]}``,
      one entry per call of a captured kind's ``__call__`` (or an embedding's ``attend``) in one
      forward pass, as :func:`note_call` records them.
    module_reasons: ``{module path: reason}`` for every module holding parameters: the reason it
      is listed as unhandled if no captured call was seen for it (e.g. ``'module kind not
      supported'``).
    kinds: the captured classes of the Flax API.

  Returns:
    ``(captured, unhandled)``: ``captured[path] = dict(kind=, meta=, out=)`` with ``kind`` one of
    ``'dense'``, ``'conv'``, ``'embed'``, ``'norm'``, ``meta`` the static metadata of its
    statistics and ``out`` the output's ``ShapeDtypeStruct``; ``unhandled[path] = reason``.
  """
  unhandled: dict[tuple[Any, ...], str] = {}
  captured: dict[tuple[Any, ...], dict] = {}
  for path, seen in calls.items():
    mod, _, in_shape, out = seen[0]
    if isinstance(mod, kinds.norms) and not (mod.use_scale or mod.use_bias):
      continue  # no parameters, nothing to precondition
    if isinstance(mod, kinds.embed) and any(method == "attend" for _, method, _, _ in seen):
      unhandled[path] = "attend() used in the forward pass (tied embedding: shared layer)"
      continue
    if len(seen) > 1:
      unhandled[path] = f"called {len(seen)} times per forward pass (shared layer)"
      continue
    meta = {}
    if isinstance(mod, kinds.conv):
      meta, reason = _conv_metadata(mod)
      if meta is None:
        unhandled[path] = reason
        continue
      if len(in_shape) < 4:
        unhandled[path] = f"conv input of shape {in_shape} has no batch axis"
        continue
      kind = "conv"
    elif isinstance(mod, kinds.embed):
      if not in_shape:
        unhandled[path] = "embedding of a scalar id (no batch axis)"
        continue
      kind = "embed"
    elif isinstance(mod, kinds.norms):
      reason = _norm_reason(mod, in_shape, kinds)
      if reason:
        unhandled[path] = reason
        continue
      kind = "norm"
      meta = dict(has_scale=bool(mod.use_scale), has_bias=bool(mod.use_bias))
    else:
      kind = "dense"
    captured[path] = dict(kind=kind, meta=meta, out=out)
  for path, reason in module_reasons.items():
    if path not in captured and path not in unhandled:
      unhandled[path] = reason
  return captured, unhandled


def _curvature_stats(captured: Mapping[tuple[Any, ...], dict],
                     unhandled: Mapping[tuple[Any, ...], str],
                     layer_inputs: Mapping[tuple[Any, ...], jax.Array],
                     cts: Mapping[tuple[Any, ...], jax.Array]) -> stats_lib.CurvatureStats:
  """Per-kind statistics from the recorded inputs (``x_hat`` for norms) and cotangents."""
  layers: dict = {}
  for path, c in captured.items():
    a, g = layer_inputs[path], cts[path]
    if c["kind"] == "conv":
      # Fold any extra leading batch axes into N (flax convs accept them).
      a = a.reshape((-1,) + a.shape[-3:])
      g = g.reshape((g.shape[0], -1) + g.shape[-3:])
      layer = stats_lib.ConvStats(inputs=a, cotangents=g, **c["meta"])
    elif c["kind"] == "embed":
      layer = stats_lib.EmbedStats(inputs=a, cotangents=g)
    elif c["kind"] == "norm":
      layer = _norm_stats(a, g, **c["meta"])
    else:
      layer = stats_lib.DenseStats(inputs=a, cotangents=g)
    _set_nested(layers, path, layer)
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

  def returns_state(mutable, apply_kwargs):
    """Whether ``model.apply`` returns ``(outputs, mutated)`` rather than ``outputs``."""
    return mutable is not False or bool(apply_kwargs.get("capture_intermediates", False))

  def apply(variables, inputs, mutable, apply_kwargs):
    """``model.apply`` as ``(outputs, mutated)``, ``mutated = None`` if nothing is mutable."""
    if not returns_state(mutable, apply_kwargs):
      return model.apply(variables, inputs, **apply_kwargs), None
    return model.apply(variables, inputs, mutable=mutable, **apply_kwargs)

  def discover(params, model_state, inputs, mutable, apply_kwargs):
    """Shapes and metadata of every module call (an abstract pass, no FLOPs)."""
    calls: dict[tuple[str, ...], list] = {}

    def record(next_fun, args, kwargs, context):
      out = next_fun(*args, **kwargs)
      mod = context.module
      method = context.method_name
      if isinstance(mod, LINEN_KINDS.captured) and (
          method == "__call__" or (method == "attend" and isinstance(mod, nn.Embed))):
        note_call(calls, mod.path, mod, method, args, kwargs, out)
      return out

    def run(p, state, x):
      with nn.intercept_methods(record):
        return apply({"params": p, **state}, x, mutable, apply_kwargs)

    jax.eval_shape(run, params, model_state, inputs)
    return calls

  def fn(params, inputs, targets, *, rng=None, model_state: Optional[Mapping] = None,
         mutable: Union[bool, str, Sequence[str]] = False, **apply_kwargs):
    options.check_rng(rng)
    model_state = dict(model_state or {})
    if "params" in model_state:
      raise ValueError("model_state holds the non-parameter collections; pass params "
                       "as the first argument.")
    calls = discover(params, model_state, inputs, mutable, apply_kwargs)
    captured, unhandled = plan_calls(
        calls, {path: "module kind not supported" for path in _module_paths(params)},
        LINEN_KINDS)
    norm_paths = {path for path, c in captured.items() if c["kind"] == "norm"}

    def forward(p, perts):
      layer_inputs = {}
      in_clone = [False]  # the x_hat clone's own call passes through the interceptor

      def intercept(next_fun, args, kwargs, context):
        path = context.module.path
        if in_clone[0] or context.method_name != "__call__" or path not in perts:
          return next_fun(*args, **kwargs)
        if path not in norm_paths:
          layer_inputs[path] = primary_input(args, kwargs)
          return next_fun(*args, **kwargs) + perts[path]
        mod = context.module
        # Non-parameter collections (batch_stats) as the layer sees them, before it updates them.
        state = {col: v for col, v in mod.variables.items() if col != "params"}
        out = next_fun(*args, **kwargs)
        plain = mod.clone(parent=None, use_scale=False, use_bias=False, dtype=out.dtype)
        in_clone[0] = True
        try:
          x_hat, _ = plain.apply(state, *args, mutable=True, **kwargs)
        finally:
          in_clone[0] = False
        layer_inputs[path] = jax.lax.stop_gradient(x_hat)
        return out + perts[path]

      with nn.intercept_methods(intercept):
        outputs, mutated = apply({"params": p, **model_state}, inputs, mutable, apply_kwargs)
      return outputs, (layer_inputs, mutated)

    loss, grads, stats, mutated = vjp_with_stats(forward, params, captured, unhandled, loss_fn,
                                                 targets, rng, options)
    if not returns_state(mutable, apply_kwargs):
      return (loss, grads), stats
    return (loss, grads), stats, mutated

  return fn
