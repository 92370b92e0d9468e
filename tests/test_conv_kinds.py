"""1-D, 3-D and grouped / depthwise convolutions (``nn.Conv``, ``nnx.Conv``) against explicit
Kronecker products of an independent NumPy im2col (loops over output positions), float64.

For every case, with and without bias, linen and NNX:

* the reference patches reproduce the layer's output group by group, and the reference
  ``a^T g / N`` is the kernel gradient (so the reference's patch order, grouping and cotangents
  are those of the layer);
* one ``scale_by_kfac`` update (whole factors) and one ``scale_by_thor`` update (blocks of 4) are
  ``(A_g + s I)^-1 dW_g (G_g + s I)^-1`` per group ``g``, with ``A_g`` and ``G_g`` the group's
  Kronecker factors (block-diagonal parts for THOR) built here from the loop im2col;
* the optimizer takes the layout from ``layers=captured_layers(stats)``; without it, kernels whose
  shapes do not show the convolution raise a ``ValueError`` that says what to do.
"""

import itertools

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import thor_optax
import thor_optax.nnx
from thor_optax._src import blocks
from thor_optax._src.layers import conv as conv_lib

import reference
from reference import F64, randn, squared_error
from reference import float64_mode  # noqa: F401  pylint: disable=unused-import (autouse fixture)

pytestmark = pytest.mark.usefixtures("fast_compiles")

N = 3
DAMPING = 0.01
BLOCK = 4
TIGHT = dict(rtol=1e-10, atol=1e-12)

CASES = {
    # name: (input spatial shape, C_in, C_out, conv settings)
    "1d": ((7,), 2, 3, dict(kernel_size=(3,), strides=(2,), padding="SAME")),
    "1d_causal_dilated": ((6,), 2, 2, dict(kernel_size=(2,), padding="CAUSAL",
                                           kernel_dilation=(2,))),
    "1d_depthwise": ((6,), 3, 3, dict(kernel_size=(3,), padding="VALID",
                                      feature_group_count=3)),
    "3d": ((3, 4, 3), 2, 2, dict(kernel_size=(2, 2, 2), strides=(1, 2, 1),
                                 padding=((1, 0), (0, 1), (1, 1)), kernel_dilation=(1, 1, 2))),
    "3d_input_dilated": ((2, 3, 2), 1, 2, dict(kernel_size=(2, 1, 2), padding=((1, 1), (0, 0),
                                                                               (0, 1)),
                                               input_dilation=(2, 1, 1))),
    "2d_groups2": ((4, 5), 4, 6, dict(kernel_size=(2, 3), padding="SAME_LOWER",
                                      feature_group_count=2)),
    "2d_depthwise": ((4, 4), 3, 6, dict(kernel_size=(3, 3), strides=(2, 1), padding="SAME",
                                        feature_group_count=3)),
}


# ------------------------------------------------------------------------------------------------
# The NumPy reference.


def _pads(sizes, kernel_size, settings):
  """``((lo, hi), ...)`` of the padding in ``settings`` (Flax's conventions)."""
  kdil = settings.get("kernel_dilation", (1,) * len(sizes))
  eff = [(k - 1) * d + 1 for k, d in zip(kernel_size, kdil)]
  padding = settings["padding"]
  if padding == "VALID":
    return ((0, 0),) * len(sizes)
  if padding == "CAUSAL":  # Flax: left pad of the dilated kernel's span, then VALID
    return ((eff[0] - 1, 0),)
  strides = settings.get("strides", (1,) * len(sizes))
  if padding == "SAME_LOWER":  # SAME with the extra pad on the low side
    return tuple((hi, lo) for lo, hi in reference.same_or_explicit_pads(sizes, eff, strides,
                                                                        "SAME"))
  return reference.same_or_explicit_pads(sizes, eff, strides, padding)


def im2col(x, settings):
  """Patches ``(N, out..., k..., C)`` of ``x (N, spatial..., C)``, one loop per output position
  and kernel tap."""
  n, *sizes, c = x.shape
  nsp = len(sizes)
  ks = settings["kernel_size"]
  strides = settings.get("strides", (1,) * nsp)
  kdil = settings.get("kernel_dilation", (1,) * nsp)
  idil = settings.get("input_dilation", (1,) * nsp)
  dsizes = [(s - 1) * d + 1 for s, d in zip(sizes, idil)]
  xd = np.zeros((n, *dsizes, c))
  xd[(slice(None),) + tuple(slice(None, None, d) for d in idil)] = x
  pads = _pads(sizes, ks, settings)
  out = [(ds + lo + hi - ((k - 1) * kd + 1)) // st + 1
         for ds, (lo, hi), k, kd, st in zip(dsizes, pads, ks, kdil, strides)]
  patches = np.zeros((n, *out, *ks, c))
  for pos in itertools.product(*map(range, out)):
    for tap in itertools.product(*map(range, ks)):
      src = [p * st + t * kd - lo for p, t, st, kd, (lo, _) in zip(pos, tap, strides, kdil, pads)]
      if all(0 <= i < ds for i, ds in zip(src, dsizes)):
        patches[(slice(None), *pos, *tap, slice(None))] = xd[(slice(None), *src, slice(None))]
  return patches


def _group_matrix(kernel, bias, g, groups):
  """Group ``g``'s ``[kernel; bias]`` as the ``(d_in (+1), C_out / G)`` matrix of its factors:
  rows ``(C_in / G, k_h, k_w)`` channel-major in 2-D, ``(k..., C_in / G)`` otherwise."""
  og = kernel.shape[-1] // groups
  w = kernel[..., g * og:(g + 1) * og]
  if w.ndim == 4:
    w = np.moveaxis(w, 2, 0)
  w = w.reshape(-1, og)
  return w if bias is None else np.concatenate([w, bias[None, g * og:(g + 1) * og]], axis=0)


def _from_group_matrices(mats, kernel_shape, has_bias, groups):
  """Inverse of :func:`_group_matrix` over all groups: ``{'kernel': ..., 'bias': ...}``."""
  og = kernel_shape[-1] // groups
  kernel = np.zeros(kernel_shape)
  bias = np.zeros(kernel_shape[-1])
  d_in = int(np.prod(kernel_shape[:-1]))
  for g, m in enumerate(mats):
    w = m[:d_in]
    if len(kernel_shape) == 4:
      kh, kw, cg, _ = kernel_shape
      w = np.moveaxis(w.reshape(cg, kh, kw, og), 0, 2)
    kernel[..., g * og:(g + 1) * og] = w.reshape(kernel_shape[:-1] + (og,))
    if has_bias:
      bias[g * og:(g + 1) * og] = m[d_in]
  return {"kernel": kernel, "bias": bias} if has_bias else {"kernel": kernel}


def _group_rows(patches, g, groups, has_bias):
  """``(N T, d_in (+1))`` rows of group ``g``'s patches, in :func:`_group_matrix`'s order."""
  nsp = (patches.ndim - 2) // 2
  cg = patches.shape[-1] // groups
  p = patches[..., g * cg:(g + 1) * cg]  # (N, out..., k..., cg)
  if nsp == 2:
    p = np.moveaxis(p, -1, 1 + nsp)  # (N, out..., cg, k...)
  rows = p.reshape(int(np.prod(p.shape[:1 + nsp])), -1)
  return np.concatenate([rows, np.ones((rows.shape[0], 1))], axis=1) if has_bias else rows


def reference_updates(x, conv_out, cotangents, params, grads, settings):
  """Per-group explicit Kronecker updates ``{'kfac': ..., 'thor': ...}`` of one conv layer,
  after checking the reference against the layer's output and gradient."""
  groups = settings.get("feature_group_count", 1)
  kernel, bias = np.asarray(params["kernel"]), params.get("bias")
  bias = None if bias is None else np.asarray(bias)
  has_bias = bias is not None
  patches = im2col(np.asarray(x), settings)
  ct = np.asarray(cotangents)
  assert ct.shape[0] == 1 and ct.shape[1:-1] == patches.shape[:patches.ndim // 2]
  og = kernel.shape[-1] // groups
  s = np.sqrt(DAMPING)
  out = {"kfac": [], "thor": []}
  for g in range(groups):
    a = _group_rows(patches, g, groups, has_bias)
    w = _group_matrix(kernel, bias, g, groups)
    y = np.asarray(conv_out)[..., g * og:(g + 1) * og].reshape(-1, og)
    np.testing.assert_allclose(a @ w, y, **TIGHT)  # the reference is the layer
    cot = ct[0, ..., g * og:(g + 1) * og].reshape(-1, og)
    grad = _group_matrix(np.asarray(grads["kernel"]), None if bias is None
                         else np.asarray(grads["bias"]), g, groups)
    np.testing.assert_allclose(a.T @ cot / N, grad, **TIGHT)  # and pairs with the gradient
    A = a.T @ a / N
    G = cot.T @ cot / cot.shape[0]
    out["kfac"].append(reference.kron_update(A, G, grad, s, s))
    out["thor"].append(reference.kron_update(reference.block_part(A, BLOCK),
                                              reference.block_part(G, BLOCK), grad, s, s))
  return {k: _from_group_matrices(v, kernel.shape, has_bias, groups) for k, v in out.items()}


# ------------------------------------------------------------------------------------------------
# Models and the package's updates.


class LinenConv(nn.Module):
  settings: dict
  features: int
  use_bias: bool

  @nn.compact
  def __call__(self, x):
    y = nn.Conv(self.features, use_bias=self.use_bias, name="conv", **self.settings)(x)
    return jnp.tanh(y).mean(axis=tuple(range(1, y.ndim - 1)))


class NNXConv(nnx.Module):

  def __init__(self, c_in, c_out, settings, use_bias):
    self.conv = nnx.Conv(c_in, c_out, use_bias=use_bias, param_dtype=F64, rngs=nnx.Rngs(0),
                         **settings)

  def __call__(self, x):
    y = self.conv(x)
    return jnp.tanh(y).mean(axis=tuple(range(1, y.ndim - 1)))


TRANSFORMS = {
    "kfac": lambda layers: thor_optax.scale_by_kfac(DAMPING, ema_decay=None, layers=layers),
    "thor": lambda layers: thor_optax.scale_by_thor(DAMPING, block_size=BLOCK,
                                                    trace_thresholds=(0.0, 0.0),
                                                    refresh_buckets=1, layers=layers),
}


def _problem(name, use_bias):
  spatial, c_in, c_out, settings = CASES[name]
  x = jnp.asarray(randn(1, (N,) + spatial + (c_in,)))
  y = jnp.asarray(randn(2, (N, c_out)))
  model = LinenConv(settings, c_out, use_bias)
  params = reference.init_params(model, x)
  return model, params, x, y, settings


def _run(capture, params, *extra):
  """``capture(params) -> ((loss, grads), stats)`` and both transforms' updates (with the
  capture's layout), in one compilation; ``extra(params)`` are returned too."""
  _, abstract = jax.eval_shape(capture, params)
  txs = {name: make(thor_optax.captured_layers(abstract)) for name, make in TRANSFORMS.items()}

  def run(params):
    (_, grads), stats = capture(params)
    updates = {name: tx.update(grads, tx.init(params), None, curvature_stats=stats)[0]
               for name, tx in txs.items()}
    return (grads, stats, updates) + tuple(f(params) for f in extra)

  return jax.jit(run, compiler_options=reference.FAST_COMPILE)(params)


def _check(got, want, grads):
  assert set(got) == set(want)
  for leaf in want:
    assert got[leaf].shape == want[leaf].shape
    np.testing.assert_allclose(got[leaf], want[leaf], rtol=1e-9, atol=1e-12, err_msg=leaf)
  ratio = np.asarray(got["kernel"]) / np.asarray(grads["kernel"])
  assert np.ptp(ratio) > 0.05  # the curvature is not a scaled identity


@pytest.mark.parametrize("use_bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_linen_updates_are_explicit_kronecker_products(name, use_bias):
  model, params, x, y, settings = _problem(name, use_bias)
  capture = thor_optax.flax.value_and_grad_with_stats(model, squared_error)
  conv = nn.Conv(y.shape[-1], use_bias=use_bias, **settings)
  grads, stats, got, conv_out = _run(lambda p: capture(p, x, y), params,
                                     lambda p: conv.apply({"params": p["conv"]}, x))
  assert stats.unhandled == ()
  layer = stats.layers["conv"]
  assert isinstance(layer, thor_optax.ConvStats)
  assert layer.feature_group_count == settings.get("feature_group_count", 1)
  assert layer.kernel_size == settings["kernel_size"]
  np.testing.assert_array_equal(layer.inputs, x)
  want = reference_updates(x, conv_out, layer.cotangents, params["conv"], grads["conv"],
                           settings)
  for method in TRANSFORMS:
    _check(got[method]["conv"], want[method], grads["conv"])
  spec = blocks.build_layout(params, BLOCK, captured=thor_optax.captured_layers(stats).kinds
                             ).layer("conv")
  groups = settings.get("feature_group_count", 1)
  assert spec.groups == groups and spec.a.copies == spec.g.copies == groups
  if spec.a.dim > BLOCK:  # THOR's blocks drop real off-diagonal parts of A
    assert not np.allclose(got["thor"]["conv"]["kernel"], got["kfac"]["conv"]["kernel"])


@pytest.mark.parametrize("use_bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_nnx_updates_are_explicit_kronecker_products(name, use_bias):
  _, params, x, y, settings = _problem(name, use_bias)
  _, c_in, c_out, _ = CASES[name]
  model = NNXConv(c_in, c_out, settings, use_bias)
  nnx.update(model, nnx.State(jax.tree.map(jnp.asarray, params)))
  graphdef, param_state, rest = nnx.split(model, nnx.Param, ...)
  capture = thor_optax.nnx.value_and_grad_with_stats(squared_error)

  def merged(p):  # the model with parameters p, inside the compiled function
    return nnx.merge(graphdef, p, rest)

  grads, stats, got, conv_out = _run(lambda p: capture(merged(p), x, y), param_state,
                                     lambda p: merged(p).conv(x))
  assert stats.unhandled == ()
  layer = stats.layers["conv"]
  assert layer.feature_group_count == settings.get("feature_group_count", 1)
  pure_grads = nnx.to_pure_dict(grads)
  want = reference_updates(x, conv_out, layer.cotangents, params["conv"], pure_grads["conv"],
                           settings)
  for method in TRANSFORMS:
    _check(nnx.to_pure_dict(nnx.State(got[method]))["conv"], want[method], pure_grads["conv"])


# ------------------------------------------------------------------------------------------------
# Layouts.


class ScannedGrouped(nn.Module):
  """Two grouped convolutions, stacked by ``nn.scan`` (``scan=True``) or unrolled."""
  scan: bool

  @nn.compact
  def __call__(self, x):
    settings = dict(features=4, kernel_size=(3, 3), padding="SAME", feature_group_count=2)
    if self.scan:

      class Body(nn.Module):

        @nn.compact
        def __call__(self, h, _):
          return jnp.tanh(nn.Conv(name="conv", **settings)(h)), None

      x, _ = nn.scan(Body, variable_axes={"params": 0}, split_rngs={"params": True},
                     length=2)(name="layers")(x, None)
    else:
      for i in range(2):
        x = jnp.tanh(nn.Conv(name=f"conv_{i}", **settings)(x))
    return x.mean(axis=(1, 2))


def test_a_scanned_stack_of_grouped_convs_is_the_unrolled_layers():
  """Stack axes and groups together: each layer of the stack and each group its own pair."""
  x = jnp.asarray(randn(3, (N, 4, 4, 4)))
  y = jnp.asarray(randn(4, (N, 4)))
  scanned = ScannedGrouped(True)
  params = reference.init_params(scanned, x)
  unrolled = {f"conv_{i}": jax.tree.map(lambda v, i=i: v[i], params["layers"]["conv"])
              for i in range(2)}
  got, want = {}, {}
  for model, p, out in ((scanned, params, got), (ScannedGrouped(False), unrolled, want)):
    capture = thor_optax.flax.value_and_grad_with_stats(model, squared_error)
    _, stats, updates = _run(lambda p, capture=capture: capture(p, x, y), p)
    assert stats.unhandled == ()
    out.update(updates)
  spec = blocks.build_layout(params, BLOCK, captured={"layers/conv": ("conv", (2, 2))}
                             ).layer("layers/conv")
  assert spec.stack == (2, 2) and spec.leading == (2,) and spec.a.copies == 4
  for method in TRANSFORMS:
    for i in range(2):
      for leaf in ("kernel", "bias"):
        np.testing.assert_allclose(got[method]["layers"]["conv"][leaf][i],
                                   want[method][f"conv_{i}"][leaf], rtol=1e-9, atol=1e-12)


def test_depthwise_layout_is_small_blocks():
  """A depthwise ``3 x 3`` conv with bias on 64 channels: 64 blocks of ``A`` (dimension 10,
  padded to 16) and 64 of ``G`` (dimension 1), whatever the block size."""
  params = {"dw": {"kernel": np.zeros((3, 3, 1, 64)), "bias": np.zeros(64)}}
  spec = blocks.build_layout(params, 128, captured={"dw": ("conv", (2, 64))}).layer("dw")
  assert spec.a == blocks.FactorSlot(dim=10, block=16, start=0, num_blocks=64, copies=64)
  assert spec.g == blocks.FactorSlot(dim=1, block=1, start=0, num_blocks=64, copies=64)
  assert spec.shapes == (("bias", (1,)), ("kernel", (3, 3, 1, 1)))
  leaves = {"kernel": jnp.arange(9 * 64.0).reshape(3, 3, 1, 64), "bias": jnp.arange(64.0)}
  split = spec.flat_stack(leaves)
  assert split["kernel"].shape == (64, 3, 3, 1, 1) and split["bias"].shape == (64, 1)
  np.testing.assert_array_equal(split["kernel"][5, ..., 0], leaves["kernel"][..., 5])
  jax.tree.map(np.testing.assert_array_equal, spec.unflat_stack(split, leaves), leaves)


def test_1d_and_3d_layouts_coincide_with_dense_general():
  """A 1-D / 3-D kernel with bias, laid out from its shapes, is a ``DenseGeneral``: the capture's
  conv layout has the same factor sizes, ``in_axes`` and kernel matrix (row-major)."""
  for kernel_shape, hint in (((3, 2, 5), (1, 1)), ((2, 3, 2, 2, 4), (3, 1))):
    params = {"c": {"kernel": np.zeros(kernel_shape), "bias": np.zeros(kernel_shape[-1])}}
    by_shape = blocks.build_layout(params, BLOCK).layer("c")
    captured = blocks.build_layout(params, BLOCK, captured={"c": ("conv", hint)}).layer("c")
    assert by_shape.kind.name == "dense_general" and captured.kind.name == "conv"
    assert (by_shape.a, by_shape.g, by_shape.in_axes) == (captured.a, captured.g,
                                                          captured.in_axes)
    kernel = jnp.asarray(randn(5, kernel_shape))
    np.testing.assert_array_equal(by_shape.kind.kernel_matrix(kernel),
                                  captured.kind.kernel_matrix(kernel))


@pytest.mark.parametrize("name", ["1d", "3d"])
def test_with_bias_the_layout_from_shapes_is_accepted(name):
  """A 1-D / 3-D conv with bias, laid out from shapes as the ``DenseGeneral`` it equals, gets
  the captured layout's update (the check step uses the statistics' kind), also under jit,
  where the two layouts are compared while the step is traced."""
  model, params, x, y, _ = _problem(name, True)
  (_, grads), stats = thor_optax.flax.value_and_grad_with_stats(model, squared_error)(
      params, x, y)
  updates = {}
  for layers in (None, thor_optax.captured_layers(stats)):
    tx = thor_optax.scale_by_kfac(DAMPING, ema_decay=None, layers=layers)
    update = jax.jit(lambda g, s, st, tx=tx: tx.update(g, s, None, curvature_stats=st)[0],
                     compiler_options=reference.FAST_COMPILE)
    updates[layers is None] = update(grads, tx.init(params), stats)
  for a, b in zip(jax.tree.leaves(updates[True]), jax.tree.leaves(updates[False])):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-13)


@pytest.mark.parametrize("name,use_bias", [("2d_groups2", True), ("1d", False),
                                           ("3d", False)])
def test_without_the_captured_layout_the_error_says_what_to_do(name, use_bias):
  model, params, x, y, _ = _problem(name, use_bias)
  (_, grads), stats = thor_optax.flax.value_and_grad_with_stats(model, squared_error)(
      params, x, y)
  tx = thor_optax.scale_by_kfac(DAMPING, ema_decay=None)
  with pytest.raises(ValueError, match=r"layers=thor_optax.captured_layers\(stats\)"):
    tx.update(grads, tx.init(params), None, curvature_stats=stats)


def _ungrouped_inputs(seed: int, num_examples: int):
  """``(name, settings, x, stats)`` of every ungrouped case (a grouped layer's groups are
  ungrouped convolutions once split): random inputs and their ``ConvStats``."""
  for name, (spatial, c_in, _, settings) in sorted(CASES.items()):
    if settings.get("feature_group_count", 1) > 1:
      continue
    x = randn(seed, (num_examples,) + spatial + (c_in,))
    nsp = len(spatial)
    yield name, settings, x, thor_optax.ConvStats(
        inputs=jnp.asarray(x), cotangents=jnp.zeros((1, 1)),
        kernel_size=settings["kernel_size"], strides=settings.get("strides", (1,) * nsp),
        padding=_pads(spatial, settings["kernel_size"], settings),
        input_dilation=settings.get("input_dilation"),
        kernel_dilation=settings.get("kernel_dilation"))


def _im2col_rows(x, settings):
  """The loop im2col as ``(N, out..., d)`` (``(k..., C)``: row-major in 1-D / 3-D)."""
  patches = im2col(x, settings)
  return patches.reshape(patches.shape[:x.ndim - 1] + (-1,))


def test_patches_are_the_loop_im2col():
  """The package's patches, in its feature order, are the loop im2col's (the ungrouped cases;
  a grouped layer's groups are ungrouped convolutions once split)."""
  for name, settings, x, stats in _ungrouped_inputs(6, 2):
    got = np.asarray(jax.jit(conv_lib.conv_patches)(stats))
    want = _im2col_rows(x, settings)
    assert got.shape == want.shape, name
    np.testing.assert_array_equal(got, want, err_msg=name)


def test_patch_moments_are_the_loop_im2col_column_sums():
  """The column sums of squares and sums that give a check step ``A``'s block traces without
  forming the patches (``patch_moments``) are those of the loop im2col, and ``T`` its positions;
  ``input_moments`` appends the bias column's (``R = N T`` twice)."""
  for name, settings, x, stats in _ungrouped_inputs(7, 3):
    squares, sums, t = conv_lib.patch_moments(stats, F64)
    rows = _im2col_rows(x, settings)
    rows = rows.reshape(-1, rows.shape[-1])
    np.testing.assert_allclose(squares, np.sum(rows**2, axis=0), rtol=1e-13, err_msg=name)
    np.testing.assert_allclose(sums, np.sum(rows, axis=0), rtol=1e-13, atol=1e-13, err_msg=name)
    assert 3 * t == rows.shape[0], name
  kind, spec = conv_lib.Conv(), blocks.build_layout(
      {"conv": {"kernel": jnp.zeros((3, 3, 2, 4)), "bias": jnp.zeros((4,))}}, 4).layer("conv")
  stats = thor_optax.ConvStats(inputs=jnp.asarray(randn(8, (2, 5, 5, 2))),
                               cotangents=jnp.zeros((1, 2, 5, 5, 4)), kernel_size=(3, 3),
                               strides=(1, 1), padding="SAME")
  squares, sums = kind.input_moments(spec, stats, F64)
  rows = kind.input_rows(spec, stats, F64).rows
  np.testing.assert_allclose(squares, np.sum(np.asarray(rows)**2, axis=0), rtol=1e-13)
  np.testing.assert_allclose(sums, np.sum(np.asarray(rows), axis=0), rtol=1e-13, atol=1e-13)
  assert squares[-1] == sums[-1] == 50.0


def test_a_check_step_forms_conv_patches_only_in_the_branches_that_use_them():
  """A check step reads a convolution's ``A`` traces from ``patch_moments`` and forms the
  patch rows only inside the branches that multiply out blocks due: the compiled step's top
  level holds neither the ``(N T, d_A)`` rows nor the ``(N, H, W, 9 C_in)`` patches, so they
  are formed only when such a branch runs (passed into a branch, they were formed at every
  check: the MNIST CNN's check update with no block due took 10.2 ms instead of 3.0 on CPU)."""

  class CNN(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.relu(nn.Conv(4, (3, 3), padding="SAME")(x))
      return nn.Dense(2)(x.reshape((x.shape[0], -1)))

  model, x = CNN(), jnp.asarray(randn(9, (4, 6, 6, 3)))
  params = reference.init_params(model, x)
  capture = thor_optax.flax.value_and_grad_with_stats(
      model, lambda out, y: jnp.mean((out - y) ** 2))
  (_, grads), stats = capture(params, x, jnp.zeros((4, 2), F64))
  tx = thor_optax.scale_by_thor(DAMPING, block_size=8)
  state = tx.init(params)
  hlo, entry = reference.top_level_hlo(
      lambda s: tx.update(grads, state, params, curvature_stats=s), stats)
  rows = "f64[144,28]"  # the patch rows with the bias column, N T = 4 * 36
  assert rows in hlo  # formed in a branch: the test sees them where they are
  assert rows not in entry and "f64[4,6,6,27]" not in entry
