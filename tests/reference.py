"""Shared helpers of the float64 dense-reference tests (exactness, factors, methods)."""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import thor_optax
from thor_optax.flax import value_and_grad_with_stats
import thor_optax.nnx

F64 = jnp.float64


@pytest.fixture(autouse=True, scope="module")
def float64_mode():
  """Dense references in float64, for the importing module's tests only."""
  with jax.enable_x64(True):
    yield


def randn(seed, shape):
  """Standard normal NumPy draws (float64)."""
  return np.random.default_rng(seed).standard_normal(shape)


def init_params(model, *args, seed=0):
  """float64 parameters of the model's shapes, drawn with NumPy (no compilation)."""
  shapes = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), *args))["params"]
  rng = np.random.default_rng(100 + seed)

  def draw(leaf):
    scale = 1.0 / np.sqrt(np.prod(leaf.shape[:-1])) if len(leaf.shape) > 1 else 0.3
    return jnp.asarray(scale * rng.standard_normal(leaf.shape), F64)

  return jax.tree.map(draw, shapes)


def capture(model, loss_fn, **kwargs):
  """Jitted ``value_and_grad_with_stats``."""
  return jax.jit(value_and_grad_with_stats(model, loss_fn, **kwargs))


def squared_error(out, y):
  """``0.5 ||out - y||^2`` per example, averaged over examples."""
  return 0.5 * jnp.sum((out - y) ** 2, axis=-1).mean()


def softmax_ce(out, y):
  """Softmax cross-entropy with integer labels, averaged over examples."""
  return optax.softmax_cross_entropy_with_integer_labels(out, y).mean()


def same_or_explicit_pads(sizes, eff_kernel, strides, padding):
  if padding == "VALID":
    return ((0, 0), (0, 0))
  if padding == "SAME":  # lax.padtype_to_pads: out = ceil(in / s), extra pad on the high side
    pads = []
    for size, k, s in zip(sizes, eff_kernel, strides):
      out = -(-size // s)
      total = max((out - 1) * s + k - size, 0)
      pads.append((total // 2, total - total // 2))
    return tuple(pads)
  return tuple(tuple(p) for p in padding)


def im2col(x, kernel_size, strides, padding, kernel_dilation=(1, 1),
                     input_dilation=(1, 1)):
  """Patches ``(N, H_out, W_out, k_h, k_w, C)`` of ``x (N, H, W, C)``, one loop per position."""
  x = np.asarray(x)
  n, h, w, c = x.shape
  kh, kw = kernel_size
  hd, wd = (h - 1) * input_dilation[0] + 1, (w - 1) * input_dilation[1] + 1
  xd = np.zeros((n, hd, wd, c), x.dtype)
  xd[:, ::input_dilation[0], ::input_dilation[1]] = x
  eff = ((kh - 1) * kernel_dilation[0] + 1, (kw - 1) * kernel_dilation[1] + 1)
  # (lax rejects string padding together with input dilation, so SAME/VALID see hd = h.)
  (plh, phh), (plw, phw) = same_or_explicit_pads((h, w), eff, strides, padding)
  ho = (hd + plh + phh - eff[0]) // strides[0] + 1
  wo = (wd + plw + phw - eff[1]) // strides[1] + 1
  patches = np.zeros((n, ho, wo, kh, kw, c), x.dtype)
  for i in range(ho):
    for j in range(wo):
      for a in range(kh):
        for b in range(kw):
          r = i * strides[0] + a * kernel_dilation[0] - plh
          q = j * strides[1] + b * kernel_dilation[1] - plw
          if 0 <= r < hd and 0 <= q < wd:
            patches[:, i, j, a, b, :] = xd[:, r, q, :]
  return patches


# Independent NumPy factors and updates: explicit im2col loops, features in HWIO order.


def stacked(layer_params):
  """``[kernel; bias]`` as a ``(d_in (+1), d_out)`` NumPy matrix, kernel in its own order."""
  k = np.asarray(layer_params["kernel"])
  k = k.reshape(-1, k.shape[-1])
  if "bias" in layer_params:
    k = np.concatenate([k, np.asarray(layer_params["bias"])[None]], axis=0)
  return k


def im2col_rows(x, kernel_size, strides, padding, kernel_dilation=(1, 1)):
  """``(N, H_out, W_out, k_h * k_w * C)`` patches, ``(k_h, k_w, C)`` order, by loops."""
  patches = im2col(x, kernel_size, strides, padding, kernel_dilation)
  return patches.reshape(patches.shape[:3] + (-1,))


def reference_factors(layer_stats, has_bias, conv=None):
  """NumPy ``A = (1/N) sum_{n,t} a a^T`` and ``G = (1/(N T)) sum_{s,n,t} g g^T``."""
  x = np.asarray(layer_stats.inputs)
  n = x.shape[0]
  if conv is not None:
    x = im2col_rows(x, **conv)
  a = x.reshape(-1, x.shape[-1])
  if has_bias:
    a = np.concatenate([a, np.ones((a.shape[0], 1))], axis=1)
  g = np.asarray(layer_stats.cotangents)
  positions = int(np.prod(g.shape[1:-1]))
  assert a.shape[0] == positions
  g = g.reshape(-1, g.shape[-1])
  return a.T @ a / n, g.T @ g / positions


def kron_update(A, G, grad, damping_a, damping_g):
  """``kron((A + d_A I)^-1, (G + d_G I)^-1) vec(dW)``, reshaped back to ``dW``'s shape."""
  a_inv = np.linalg.inv(A + damping_a * np.eye(A.shape[0]))
  g_inv = np.linalg.inv(G + damping_g * np.eye(G.shape[0]))
  return (np.kron(a_inv, g_inv) @ grad.reshape(-1)).reshape(grad.shape)


def unstack(mat, layer_params):
  """Inverse of :func:`stacked`: ``{"kernel": ..., "bias": ...}`` in the layer's shapes."""
  kernel_shape = layer_params["kernel"].shape
  d_in = int(np.prod(kernel_shape[:-1]))
  out = {"kernel": mat[:d_in].reshape(kernel_shape)}
  if "bias" in layer_params:
    out["bias"] = mat[d_in]
  return out


def block_part(F, b):
  """Block-diagonal part of ``F`` under THOR's split (one block if ``dim <= b``)."""
  d = F.shape[0]
  if d <= b:
    return F.copy()
  out = np.zeros_like(F)
  for s in range(0, d, b):
    out[s:s + b, s:s + b] = F[s:s + b, s:s + b]
  return out


def stack_field(state, piece, field):
  """``{group: array}``: one field of one piece of every block stack of a ``KroneckerState``
  that has it (e.g. ``('inverse', 'inverse')``: the damped inverse blocks ``(n, b, b)``)."""
  return {g: getattr(s[piece], field) for g, s in state.blocks.items()
          if piece in s and hasattr(s[piece], field)}


def inverse_blocks(state):
  """``{group: (n, b, b)}`` damped inverse blocks of the dense block stacks of a state."""
  return stack_field(state, "inverse", "inverse")


def assert_orbax_round_trip(tree, target, directory):
  """Saves ``tree`` with orbax into ``directory``, restores it into ``target`` (its
  ``jax.eval_shape``) and asserts the structure, dtypes and every value are the same."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(directory, tree)
    checkpointer.wait_until_finished()
    restored = checkpointer.restore(directory, target)
  assert jax.tree.structure(restored) == jax.tree.structure(tree)
  for (path, got), want in zip(jax.tree_util.tree_flatten_with_path(restored)[0],
                               jax.tree.leaves(tree)):
    assert got.dtype == want.dtype, jax.tree_util.keystr(path)
    np.testing.assert_array_equal(got, want, err_msg=jax.tree_util.keystr(path))


# XLA options for steps compiled once in a test: compile several times faster, run slower.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}


def train_with_capture(capture, tx, params, inputs, targets, steps):
  """``steps`` jitted steps of ``tx`` on one batch with the capture's statistics every step:
  ``(params, opt_state, losses)``."""
  import optax  # pylint: disable=import-outside-toplevel

  @jax.jit
  def step(params, opt_state):
    (loss, grads), stats = capture(params, inputs, targets)
    updates, opt_state = tx.update(grads, opt_state, params, curvature_stats=stats)
    return optax.apply_updates(params, updates), opt_state, loss

  opt_state, losses = tx.init(params), []
  for _ in range(steps):
    params, opt_state, loss = step(params, opt_state)
    losses.append(float(loss))
  return params, opt_state, losses


def refreshed_layers(opt_state):
  """Names of the layers whose blocks a check step has refreshed at least once."""
  return {name for name, d in kronecker_state(opt_state).diagnostics.items()
          if int(d.total_refreshes) > 0}


def kronecker_state(opt_state):
  """The first ``thor_optax.KroneckerState`` in an optimizer state (an alias's is inside its
  ``skip_not_finite`` guard and its chain), or ``None``."""
  import thor_optax  # pylint: disable=import-outside-toplevel
  is_kron = lambda x: isinstance(x, thor_optax.KroneckerState)
  return next((x for x in jax.tree_util.tree_leaves(opt_state, is_leaf=is_kron) if is_kron(x)),
              None)


def top_level_hlo(fn, *args) -> tuple[str, str]:
  """``(whole, top level)`` of ``jax.jit(fn)``'s compiled HLO text for ``args``: the top level
  is its entry computation, where the branches of a ``cond`` / ``switch`` are computations
  apart (a value formed only inside a branch appears in the whole text, not at the top)."""
  hlo = jax.jit(fn).lower(*args).compile().as_text()
  entry = hlo[hlo.index("\nENTRY"):]
  return hlo, entry[:entry.index("\n}")]


def layout_transforms(damping):
  """The transforms the layer-equivalence tests run, each ``make(layers) -> transform`` of the
  optimizer's ``layers=``: K-FAC (Cholesky), THOR with 4-blocks and every block refreshed,
  K-FAC with eigendecompositions."""
  return {
      "kfac": lambda layers: thor_optax.scale_by_kfac(damping, ema_decay=None, layers=layers),
      "thor_b4": lambda layers: thor_optax.scale_by_thor(damping, block_size=4,
                                                         trace_thresholds=(0.0, 0.0),
                                                         layers=layers),
      "eigh": lambda layers: thor_optax.scale_by_kfac(damping, ema_decay=None,
                                                      inverse_method="eigh", layers=layers),
  }


def captured_update(model, params, x, y, loss_fn, make_tx, captured=False, jit=False):
  """``(updates, grads, stats)`` of one check step from a fresh state: the capture jitted, the
  transform ``make_tx(layers)`` given the capture's layout when ``captured``."""
  (_, grads), stats = capture(model, loss_fn)(params, x, y)
  tx = make_tx(thor_optax.captured_layers(stats) if captured else None)

  def update(g, s, p, st):
    return tx.update(g, s, p, curvature_stats=st)[0]

  updates = (jax.jit(update) if jit else update)(grads, tx.init(params), params, stats)
  return updates, grads, stats


def nnx_captured_update(model, x, y, loss_fn, tx_of_layers):
  """``(updates as a pure dict, stats)`` of one check step of an NNX model from a fresh state,
  jitted: the transform ``tx_of_layers(layers)`` given the capture's layout (from
  ``nnx.eval_shape`` of the capture)."""
  capture = thor_optax.nnx.value_and_grad_with_stats(loss_fn)
  _, shapes = nnx.eval_shape(lambda m: capture(m, x, y), model)
  tx = tx_of_layers(thor_optax.captured_layers(shapes))

  @nnx.jit
  def run(model, x, y):
    (_, grads), stats = capture(model, x, y)
    params = nnx.state(model, nnx.Param)
    return tx.update(grads, tx.init(params), params, curvature_stats=stats)[0], stats

  updates, stats = run(model, x, y)
  return nnx.to_pure_dict(updates), stats


def assert_trees_close(got, want, atol=1e-13):
  """Every leaf of two trees of the same structure agrees to ``atol``."""
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for path, a in jax.tree_util.tree_flatten_with_path(got)[0]:
    b = want
    for key in path:
      b = b[key.key]
    np.testing.assert_allclose(a, b, rtol=0, atol=atol, err_msg=jax.tree_util.keystr(path))
