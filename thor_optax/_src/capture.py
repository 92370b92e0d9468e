"""Capture of curvature statistics from an unchanged Flax linen model.

``value_and_grad_with_stats(model, loss_fn)`` returns a function that, in one forward and one
backward pass, gives the loss, the parameter gradients and the curvature statistics of every
captured layer. It wraps ``model.apply`` in ``flax.linen.intercept_methods``: each captured
layer's input is recorded and a zero perturbation is added to its output, so the cotangent of
that perturbation, returned by the same ``jax.vjp`` that gives the parameter gradients, is the
layer's output cotangent.

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


def _conv_metadata(mod: nn.Conv) -> tuple[Optional[dict], str]:
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


_NORMS = (nn.BatchNorm, nn.LayerNorm)
_CAPTURED_KINDS = (nn.Dense, nn.Conv, nn.Embed) + _NORMS


def _canonical_axes(axes: Any, ndim: int) -> tuple[int, ...]:
  axes = (axes,) if isinstance(axes, int) else tuple(axes)
  return tuple(sorted({int(a) % ndim for a in axes}))


def _norm_reason(mod: nn.Module, in_shape: tuple[int, ...]) -> str:
  """Why a BatchNorm/LayerNorm call cannot be captured (``''`` if it can)."""
  ndim = len(in_shape)
  if ndim < 2:
    return f"normalization input of shape {in_shape} has no batch axis"
  if isinstance(mod, nn.BatchNorm):
    feature_axes = _canonical_axes(mod.axis, ndim)
    name = "axis"
  else:
    feature_axes = _canonical_axes(mod.feature_axes, ndim)
    name = "feature_axes"
  if feature_axes != (ndim - 1,):
    return (f"{name}={feature_axes} on a rank-{ndim} input: only scale and bias over the last "
            "axis are supported")
  return ""


def _primary_input(args: tuple, kwargs: dict) -> Any:
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


def _set_nested(tree: dict, path: tuple[str, ...], value: Any) -> None:
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
  if fisher_type not in FISHER_TYPES:
    raise ValueError(f"fisher_type must be one of {FISHER_TYPES}, got {fisher_type!r}")
  if fisher_type != "empirical" and likelihood not in LIKELIHOODS:
    raise ValueError(
        f"fisher_type={fisher_type!r} needs likelihood in {LIKELIHOODS}, got {likelihood!r}")
  if loss_reduction not in ("mean", "sum"):
    raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
  if num_samples < 1:
    raise ValueError(f"num_samples must be >= 1, got {num_samples}")

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
      if isinstance(mod, _CAPTURED_KINDS) and (
          method == "__call__" or (method == "attend" and isinstance(mod, nn.Embed))):
        calls.setdefault(mod.path, []).append(
            (mod, method, _primary_input(args, kwargs).shape,
             jax.ShapeDtypeStruct(out.shape, out.dtype)))
      return out

    def run(p, state, x):
      with nn.intercept_methods(record):
        return apply({"params": p, **state}, x, mutable, apply_kwargs)

    jax.eval_shape(run, params, model_state, inputs)
    return calls

  def plan(calls, params):
    """Which calls are captured (``path -> kind, metadata``) and why others are not."""
    unhandled: dict[tuple[str, ...], str] = {}
    captured: dict[tuple[str, ...], dict] = {}
    for path, seen in calls.items():
      mod, _, in_shape, out = seen[0]
      if isinstance(mod, _NORMS) and not (mod.use_scale or mod.use_bias):
        continue  # no parameters, nothing to precondition
      if isinstance(mod, nn.Embed) and any(method == "attend" for _, method, _, _ in seen):
        unhandled[path] = "attend() used in the forward pass (tied embedding: shared layer)"
        continue
      if len(seen) > 1:
        unhandled[path] = f"called {len(seen)} times per forward pass (shared layer)"
        continue
      meta = {}
      if isinstance(mod, nn.Conv):
        meta, reason = _conv_metadata(mod)
        if meta is None:
          unhandled[path] = reason
          continue
        if len(in_shape) < 4:
          unhandled[path] = f"conv input of shape {in_shape} has no batch axis"
          continue
        kind = "conv"
      elif isinstance(mod, nn.Embed):
        if not in_shape:
          unhandled[path] = "embedding of a scalar id (no batch axis)"
          continue
        kind = "embed"
      elif isinstance(mod, _NORMS):
        reason = _norm_reason(mod, in_shape)
        if reason:
          unhandled[path] = reason
          continue
        kind = "norm"
        meta = dict(has_scale=bool(mod.use_scale), has_bias=bool(mod.use_bias))
      else:
        kind = "dense"
      captured[path] = dict(kind=kind, meta=meta, out=out)
    for path in _module_paths(params):
      if path not in captured and path not in unhandled:
        unhandled[path] = "module kind not supported"
    return captured, unhandled

  def fn(params, inputs, targets, *, rng=None, model_state: Optional[Mapping] = None,
         mutable: Union[bool, str, Sequence[str]] = False, **apply_kwargs):
    if fisher_type == "sampled" and rng is None:
      raise ValueError("fisher_type='sampled' draws targets from the model: pass rng=<PRNGKey>.")
    model_state = dict(model_state or {})
    if "params" in model_state:
      raise ValueError("model_state holds the non-parameter collections; pass params "
                       "as the first argument.")
    calls = discover(params, model_state, inputs, mutable, apply_kwargs)
    captured, unhandled = plan(calls, params)

    perturbations = {path: jnp.zeros(c["out"].shape, c["out"].dtype)
                     for path, c in captured.items()}
    norm_paths = {path for path, c in captured.items() if c["kind"] == "norm"}

    def forward(p, perts):
      layer_inputs = {}
      in_clone = [False]  # the x_hat clone's own call passes through the interceptor

      def intercept(next_fun, args, kwargs, context):
        path = context.module.path
        if in_clone[0] or context.method_name != "__call__" or path not in perts:
          return next_fun(*args, **kwargs)
        if path not in norm_paths:
          layer_inputs[path] = args[0] if args else _primary_input(args, kwargs)
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

    outputs, vjp_fn, (layer_inputs, mutated) = jax.vjp(
        forward, params, perturbations, has_aux=True)
    loss, dloss = jax.value_and_grad(loss_fn)(outputs, targets)
    grads, layer_cts = vjp_fn(dloss.astype(outputs.dtype))
    n_examples = math.prod(outputs.shape[:-1]) if loss_reduction == "mean" else 1
    if fisher_type == "empirical":
      cts = jax.tree_util.tree_map(lambda c: (c * n_examples)[None], layer_cts)
    else:
      out_cts = output_cotangents(outputs, dloss, n_examples, fisher_type, likelihood,
                                  num_samples, rng)
      cts = jax.vmap(lambda ct: vjp_fn(ct)[1])(out_cts)

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
    notes = tuple(f"{'/'.join(p)}: {why}" for p, why in sorted(unhandled.items()))
    stats = stats_lib.CurvatureStats(layers=layers, unhandled=notes)
    if not returns_state(mutable, apply_kwargs):
      return (loss, grads), stats
    return (loss, grads), stats, mutated

  return fn
