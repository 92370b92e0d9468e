"""Attention projections: ``nn.DenseGeneral`` / ``nnx.LinearGeneral`` layers are preconditioned
as the dense layers they are once their kernels are reshaped to ``(d_in, d_out)``.

References are the same models written with ``nn.Dense`` and explicit reshapes (whose factors
the dense-reference tests check against explicit Kronecker products), and explicit Kronecker
products of the flattened statistics. Float64.
"""

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import thor_optax
import thor_optax.flax
import thor_optax.nnx

import reference
from reference import float64_mode, randn, softmax_ce, squared_error  # pylint: disable=unused-import

pytestmark = pytest.mark.usefixtures("fast_compiles")

N, T, D, H, HD, K = 3, 4, 6, 2, 3, 5
DAMPING = 0.01


class General(nn.Module):
  """``DenseGeneral`` to ``(H, HD)`` heads, tanh, ``DenseGeneral`` contracting both (Flax sorts
  ``axis``: ``(-1, -2)`` is the same layer, kernel ``(H, HD, K)``)."""
  use_bias: bool = True
  out_axis: tuple = (-2, -1)

  @nn.compact
  def __call__(self, x):
    q = nn.DenseGeneral((H, HD), use_bias=self.use_bias, name="q")(x)
    return nn.DenseGeneral(K, axis=self.out_axis, use_bias=self.use_bias, name="o")(jnp.tanh(q))


class Flat(nn.Module):
  """The same map with ``nn.Dense`` layers (heads flattened)."""
  use_bias: bool = True

  @nn.compact
  def __call__(self, x):
    q = nn.Dense(H * HD, use_bias=self.use_bias, name="q")(x)
    return nn.Dense(K, use_bias=self.use_bias, name="o")(jnp.tanh(q))


def _flat_params(params):
  """``General``'s parameters as ``Flat``'s: every leaf reshaped to its dense layout."""
  out = {"q": {"kernel": params["q"]["kernel"].reshape(D, H * HD)},
         "o": {"kernel": params["o"]["kernel"].reshape(H * HD, K)}}
  if "bias" in params["q"]:
    out["q"]["bias"] = params["q"]["bias"].reshape(H * HD)
    out["o"]["bias"] = params["o"]["bias"]
  return out


_assert_close = reference.assert_trees_close
_update = reference.captured_update
TRANSFORMS = reference.layout_transforms(DAMPING)


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
@pytest.mark.parametrize("use_bias,out_axis", [(True, (-2, -1)), (False, (-2, -1)),
                                               (True, (-1, -2))])
def test_dense_general_equals_the_reshaped_dense_model(name, use_bias, out_axis):
  x = jnp.asarray(randn(0, (N, T, D)))
  y = jnp.asarray(np.random.default_rng(1).integers(0, K, (N, T)))
  model = General(use_bias, out_axis)
  params = reference.init_params(model, x)
  # Without a bias the kernels' shapes are ambiguous: the capture's layout is needed.
  got, grads, stats = _update(model, params, x, y, softmax_ce, TRANSFORMS[name],
                              captured=not use_bias)
  assert not stats.unhandled
  assert isinstance(stats.layers["q"], thor_optax.DenseGeneralStats)
  want, _, _ = _update(Flat(use_bias), _flat_params(params), x, y, softmax_ce, TRANSFORMS[name])
  _assert_close(_flat_params(got), want)
  assert float(jnp.abs(got["q"]["kernel"] + grads["q"]["kernel"]).max()) > 1e-2


def test_dense_general_factors_are_the_explicit_kronecker_product():
  """One ``DenseGeneral`` over two contracted axes: the update is ``(A + s I)^-1 (x)
  (G + s I)^-1`` applied to the kernel reshaped to ``(H HD (+1), K)``, with ``A`` and ``G``
  built in NumPy from the layer's input and output cotangents reshaped by hand."""

  class Out(nn.Module):

    @nn.compact
    def __call__(self, x):
      return nn.DenseGeneral(K, axis=(-2, -1), name="o")(x)

  x = jnp.asarray(randn(2, (N, T, H, HD)))
  y = jnp.asarray(randn(3, (N, T, K)))
  params = reference.init_params(Out(), x)
  tx = thor_optax.scale_by_kfac(DAMPING, ema_decay=None)
  updates, grads, _ = _update(Out(), params, x, y, squared_error, lambda _: tx)
  out = Out().apply({"params": params}, x)
  a = np.concatenate([np.asarray(x).reshape(-1, H * HD), np.ones((N * T, 1))], axis=1)
  g = (np.asarray(out) - np.asarray(y)).reshape(-1, K)  # per-term cotangents of 0.5||.||^2
  s = np.sqrt(DAMPING)
  grad = reference.stacked({k: np.asarray(v) for k, v in grads["o"].items()})
  want = reference.kron_update(a.T @ a / (N * T), g.T @ g / (N * T), grad, s, s)
  np.testing.assert_allclose(reference.stacked(updates["o"]), want, rtol=0, atol=1e-12)


def test_bias_less_dense_general_without_the_captured_layout_says_what_to_do():
  x = jnp.asarray(randn(0, (N, T, D)))
  y = jnp.asarray(np.random.default_rng(1).integers(0, K, (N, T)))
  params = reference.init_params(General(False), x)
  with pytest.raises(ValueError, match=r"layers=thor_optax.captured_layers\(stats\)"):
    _update(General(False), params, x, y, softmax_ce, TRANSFORMS["kfac"])


class LinenAttention(nn.Module):
  """Self-attention with Flax's module (causal), then a dense head."""

  @nn.compact
  def __call__(self, x):
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
    h = nn.MultiHeadDotProductAttention(num_heads=H, qkv_features=H * HD, name="attn")(
        x, mask=mask)
    return nn.Dense(K, name="head")(h)


class DenseAttention(nn.Module):
  """The same attention written with ``nn.Dense`` projections and reshapes."""

  @nn.compact
  def __call__(self, x):
    heads = lambda name: nn.Dense(H * HD, name=name)(x).reshape(x.shape[:2] + (H, HD))
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
    o = nn.dot_product_attention(heads("query"), heads("key"), heads("value"), mask=mask)
    h = nn.Dense(D, name="out")(o.reshape(x.shape[:2] + (H * HD,)))
    return nn.Dense(K, name="head")(h)


def _as_dense(params):
  attn = params["attn"]
  dense = {name: {"kernel": attn[name]["kernel"].reshape(D, H * HD),
                  "bias": attn[name]["bias"].reshape(H * HD)}
           for name in ("query", "key", "value")}
  dense["out"] = {"kernel": attn["out"]["kernel"].reshape(H * HD, D),
                  "bias": attn["out"]["bias"]}
  return {**dense, "head": params["head"]}


def test_multi_head_attention_is_preconditioned_like_its_dense_form():
  x = jnp.asarray(randn(4, (N, T, D)))
  y = jnp.asarray(np.random.default_rng(5).integers(0, K, (N, T)))
  params = reference.init_params(LinenAttention(), x)
  make_tx = TRANSFORMS["thor_b4"]
  got, _, stats = _update(LinenAttention(), params, x, y, softmax_ce, make_tx)
  assert not stats.unhandled
  assert sorted(stats.layers["attn"]) == ["key", "out", "query", "value"]
  want, _, _ = _update(DenseAttention(), _as_dense(params), x, y, softmax_ce, make_tx)
  _assert_close(_as_dense(got), want)


class NnxAttention(nnx.Module):
  """``nnx.MultiHeadAttention`` then a dense head: causal and per position, or unmasked with
  the positions pooled (a loss per example)."""

  def __init__(self, pooled: bool):
    self.pooled = pooled
    self.attn = nnx.MultiHeadAttention(H, D, qkv_features=H * HD, decode=False,
                                       param_dtype=jnp.float64, rngs=nnx.Rngs(0))
    self.head = nnx.Linear(D, K, param_dtype=jnp.float64, rngs=nnx.Rngs(1))

  def __call__(self, x):
    if self.pooled:
      return self.head(self.attn(x).mean(axis=1))
    return self.head(self.attn(x, mask=nn.make_causal_mask(jnp.ones(x.shape[:2]))))


def test_nnx_multi_head_attention_matches_linen():
  """``nnx.MultiHeadAttention`` (``nnx.LinearGeneral`` projections) with the linen model's
  parameters gives the linen model's updates, to the 1e-7 by which Flax's two attention
  modules' float64 outputs differ (measured: 7.7e-8 on these inputs; the updates differ by
  3.7e-8, and by 1e-2 with a wrong layout)."""
  x = jnp.asarray(randn(4, (N, T, D)))
  y = jnp.asarray(np.random.default_rng(5).integers(0, K, (N, T)))
  params = reference.init_params(LinenAttention(), x)

  model = NnxAttention(pooled=False)
  nnx.update(model, nnx.State(jax.tree.map(lambda v: v, params)))
  (_, grads), stats = thor_optax.nnx.value_and_grad_with_stats(softmax_ce)(model, x, y)
  assert not stats.unhandled
  assert isinstance(stats.layers["attn"]["query"], thor_optax.DenseGeneralStats)
  tx = TRANSFORMS["thor_b4"](None)
  got, _ = tx.update(grads, tx.init(nnx.state(model, nnx.Param)), curvature_stats=stats)
  want, _, _ = _update(LinenAttention(), params, x, y, softmax_ce, TRANSFORMS["thor_b4"])
  _assert_close(nnx.to_pure_dict(nnx.State(got)), want, atol=1e-6)


class PooledAttention(nn.Module):
  """Self-attention, positions pooled, a dense head: a loss per example (``'auto'``: reduce)."""

  @nn.compact
  def __call__(self, x):
    h = nn.MultiHeadDotProductAttention(num_heads=H, qkv_features=H * HD, name="attn")(x)
    return nn.Dense(K, name="head")(h.mean(axis=1))


def test_auto_expands_the_attention_key_under_a_per_example_loss():
  """Softmax is invariant to a shift of all keys, so the key projection's cotangents sum to
  zero over each example's positions: K-FAC-reduce's ``G`` vanished and the key kept the
  identity for ``G`` (a step ``1/sqrt(lambda)`` times smaller than the formula's). ``'auto'``
  expands the key (its update equals the all-expand capture's) and reduces the other
  projections (equal to the all-reduce capture's), linen and NNX."""
  x = jnp.asarray(randn(6, (N, T, D)))
  y = jnp.arange(N) % K
  params = reference.init_params(PooledAttention(), x)
  make_tx = TRANSFORMS["kfac"]
  (_, _), raw = reference.capture(PooledAttention(), softmax_ce, weight_sharing="reduce")(
      params, x, y)
  reduced_key = np.abs(np.asarray(raw.layers["attn"]["key"].cotangents)).max()
  assert reduced_key < 1e-14  # the vanishing G of reduce
  updates = {}
  for sharing in ("auto", "expand", "reduce"):
    (_, grads), stats = reference.capture(PooledAttention(), softmax_ce,
                                          weight_sharing=sharing)(params, x, y)
    tx = make_tx(None)
    updates[sharing] = tx.update(grads, tx.init(params), params, curvature_stats=stats)[0]
    if sharing == "auto":
      assert stats.layers["attn"]["key"].cotangents.shape == (1, N, T, H * HD)
      assert stats.layers["attn"]["query"].cotangents.shape == (1, N, H * HD)
      assert "attn/key" in stats.exact_rows
  attn = {k: v["attn"] for k, v in updates.items()}
  _assert_close(attn["auto"]["key"], attn["expand"]["key"])
  for name in ("query", "value", "out"):
    _assert_close(attn["auto"][name], attn["reduce"][name])
  assert float(jnp.abs(attn["auto"]["key"]["kernel"] - attn["reduce"]["key"]["kernel"]).max()
               ) > 1e-3

  (_, _), stats = thor_optax.nnx.value_and_grad_with_stats(softmax_ce)(
      NnxAttention(pooled=True), x, y)
  assert stats.layers["attn"]["key"].cotangents.shape == (1, N, T, H * HD)
  assert stats.layers["attn"]["value"].cotangents.shape == (1, N, H * HD)


class Gemma(nn.Module):
  """Einsum projections as Gemma writes them: query ``'btd,ndh->btnh'`` (the contracted axis in
  the kernel's middle), output ``'btnh,nhk->btk'``."""
  use_bias: bool = True

  @nn.compact
  def __call__(self, x):
    q = nn.Einsum((H, D, HD), "btd,ndh->btnh", use_bias=self.use_bias, name="q")(x)
    return nn.Einsum((H, HD, K), "btnh,nhk->btk", use_bias=self.use_bias, name="o")(jnp.tanh(q))


def _gemma_as_flat(params):
  """``Gemma``'s parameters as ``Flat``'s (the query kernel's axes to ``(d, n, h)``)."""
  out = {"q": {"kernel": jnp.transpose(params["q"]["kernel"], (1, 0, 2)).reshape(D, H * HD)},
         "o": {"kernel": params["o"]["kernel"].reshape(H * HD, K)}}
  if "bias" in params["q"]:
    out["q"]["bias"] = params["q"]["bias"].reshape(H * HD)
    out["o"]["bias"] = params["o"]["bias"]
  return out


@pytest.mark.parametrize("use_bias", [True, False])
def test_einsum_equals_the_reshaped_dense_model(use_bias):
  x = jnp.asarray(randn(0, (N, T, D)))
  y = jnp.asarray(np.random.default_rng(1).integers(0, K, (N, T)))
  params = reference.init_params(Gemma(use_bias), x)
  make_tx = TRANSFORMS["thor_b4"]
  got, _, stats = _update(Gemma(use_bias), params, x, y, softmax_ce, make_tx, captured=True)
  assert not stats.unhandled
  assert isinstance(stats.layers["q"], thor_optax.EinsumStats)
  want, _, _ = _update(Flat(use_bias), _gemma_as_flat(params), x, y, softmax_ce, make_tx)
  _assert_close(_gemma_as_flat(got), want)


def test_einsum_layout_from_shapes_alone():
  """Without the captured layout: the output einsum (kernel ``(n, h, k)``, bias ``(k,)``) has
  a ``DenseGeneral``'s layout, so it is accepted; the query's permuted kernel is not, and the
  error says what to pass."""

  class Out(nn.Module):

    @nn.compact
    def __call__(self, x):
      return nn.Einsum((H, HD, K), "btnh,nhk->btk", name="o")(x)

  x = jnp.asarray(randn(2, (N, T, H, HD)))
  y = jnp.asarray(np.random.default_rng(1).integers(0, K, (N, T)))
  params = reference.init_params(Out(), x)
  got, _, _ = _update(Out(), params, x, y, softmax_ce, TRANSFORMS["kfac"])
  want, _, _ = _update(Out(), params, x, y, softmax_ce, TRANSFORMS["kfac"], captured=True)
  _assert_close(got, want)
  # Under jit too: the layouts are compared on a constant probe while the step is traced.
  got, _, _ = _update(Out(), params, x, y, softmax_ce, TRANSFORMS["kfac"], jit=True)
  _assert_close(got, want)
  params = reference.init_params(Gemma(), jnp.asarray(randn(0, (N, T, D))))
  with pytest.raises(ValueError, match=r"layers=thor_optax.captured_layers\(stats\)"):
    _update(Gemma(), params, jnp.asarray(randn(0, (N, T, D))), y, softmax_ce, TRANSFORMS["kfac"])


def test_einsum_that_is_not_a_matrix_product_is_listed():
  """A kernel per head (``'btnh,nhk->btnk'``: ``n`` in input, kernel and output) is listed."""

  class PerHead(nn.Module):

    @nn.compact
    def __call__(self, x):
      h = nn.Einsum((H, HD, K), "btnh,nhk->btnk", name="per_head")(x)
      return nn.Dense(K, name="head")(h.reshape(h.shape[:2] + (-1,)))

  x = jnp.asarray(randn(2, (N, T, H, HD)))
  y = jnp.asarray(np.random.default_rng(1).integers(0, K, (N, T)))
  params = reference.init_params(PerHead(), x)
  (_, _), stats = reference.capture(PerHead(), softmax_ce)(params, x, y)
  assert set(stats.layers) == {"head"}
  assert any(note.startswith("per_head: ") and "kernel per index" in note
             for note in stats.unhandled)


def test_nnx_einsum_matches_linen():
  x = jnp.asarray(randn(0, (N, T, D)))
  y = jnp.asarray(np.random.default_rng(1).integers(0, K, (N, T)))
  params = reference.init_params(Gemma(), x)

  class Model(nnx.Module):

    def __init__(self):
      self.q = nnx.Einsum("btd,ndh->btnh", (H, D, HD), (H, HD), param_dtype=jnp.float64,
                          rngs=nnx.Rngs(0))
      self.o = nnx.Einsum("btnh,nhk->btk", (H, HD, K), (K,), param_dtype=jnp.float64,
                          rngs=nnx.Rngs(1))

    def __call__(self, x):
      return self.o(jnp.tanh(self.q(x)))

  model = Model()
  nnx.update(model, nnx.State(params))
  (_, grads), stats = thor_optax.nnx.value_and_grad_with_stats(softmax_ce)(model, x, y)
  assert not stats.unhandled
  tx = TRANSFORMS["thor_b4"](thor_optax.captured_layers(stats))
  got, _ = tx.update(grads, tx.init(nnx.state(model, nnx.Param)), curvature_stats=stats)
  want, _, _ = _update(Gemma(), params, x, y, softmax_ce, TRANSFORMS["thor_b4"], captured=True)
  _assert_close(nnx.to_pure_dict(nnx.State(got)), want)
