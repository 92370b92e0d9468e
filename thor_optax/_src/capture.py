"""Capture of curvature statistics from an unchanged Flax linen model.

``value_and_grad_with_stats(model, loss_fn)`` returns a function that, in one forward and one
backward pass, gives the loss, the parameter gradients and every ``nn.Dense`` / ``nn.Conv``
layer's input and output cotangent. It wraps ``model.apply`` in ``flax.linen.intercept_methods``:
each captured layer's input is recorded and a zero perturbation is added to its output, so the
cotangent of that perturbation, returned by the same ``jax.vjp`` that gives the parameter
gradients, is the layer's output cotangent.

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
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

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
) -> Callable[..., tuple[tuple[jax.Array, Any], stats_lib.CurvatureStats]]:
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
    ``fn(params, inputs, targets, *, rng=None, **apply_kwargs)`` returning
    ``((loss, grads), stats)``; ``grads`` mirrors ``params`` and ``stats`` is a
    :class:`CurvatureStats` whose ``layers`` mirror ``params`` at every captured layer (inputs
    ``(N, ..., d_in)`` or ``(N, H, W, C)``, cotangents ``(S, N, ..., d_out)``) and whose
    ``unhandled`` lists modules with parameters that were not captured (shared layers,
    unsupported kinds); their gradients pass through the transforms unchanged.
    ``apply_kwargs`` go to ``model.apply`` (e.g. ``rngs=`` for dropout).

  Raises:
    ValueError: on an unknown ``fisher_type``, ``likelihood`` or ``loss_reduction``, a sampled
      or exact Fisher without a ``likelihood``, or a sampled Fisher called without ``rng``.
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

  def discover(params, inputs, apply_kwargs):
    """Shapes and metadata of every module call (an abstract pass, no FLOPs)."""
    calls: dict[tuple[str, ...], list] = {}

    def record(next_fun, args, kwargs, context):
      out = next_fun(*args, **kwargs)
      mod = context.module
      if context.method_name == "__call__" and isinstance(mod, (nn.Dense, nn.Conv)):
        calls.setdefault(mod.path, []).append(
            (mod, args[0].shape, jax.ShapeDtypeStruct(out.shape, out.dtype)))
      return out

    def run(p, x):
      with nn.intercept_methods(record):
        return model.apply({"params": p}, x, **apply_kwargs)

    jax.eval_shape(run, params, inputs)
    return calls

  def fn(params, inputs, targets, *, rng=None, **apply_kwargs):
    if fisher_type == "sampled" and rng is None:
      raise ValueError("fisher_type='sampled' draws targets from the model: pass rng=<PRNGKey>.")
    calls = discover(params, inputs, apply_kwargs)
    unhandled: dict[tuple[str, ...], str] = {}
    captured: dict[tuple[str, ...], dict] = {}
    for path, seen in calls.items():
      mod, in_shape, out = seen[0]
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
      captured[path] = dict(kind="conv" if isinstance(mod, nn.Conv) else "dense", meta=meta,
                            out=out)
    for path in _module_paths(params):
      if path not in captured and path not in unhandled:
        unhandled[path] = "module kind not supported"

    perturbations = {path: jnp.zeros(c["out"].shape, c["out"].dtype)
                     for path, c in captured.items()}

    def forward(p, perts):
      layer_inputs = {}

      def intercept(next_fun, args, kwargs, context):
        path = context.module.path
        if context.method_name != "__call__" or path not in perts:
          return next_fun(*args, **kwargs)
        layer_inputs[path] = args[0]
        return next_fun(*args, **kwargs) + perts[path]

      with nn.intercept_methods(intercept):
        outputs = model.apply({"params": p}, inputs, **apply_kwargs)
      return outputs, layer_inputs

    outputs, vjp_fn, layer_inputs = jax.vjp(forward, params, perturbations, has_aux=True)
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
      else:
        layer = stats_lib.DenseStats(inputs=a, cotangents=g)
      _set_nested(layers, path, layer)
    notes = tuple(f"{'/'.join(p)}: {why}" for p, why in sorted(unhandled.items()))
    return (loss, grads), stats_lib.CurvatureStats(layers=layers, unhandled=notes)

  return fn
