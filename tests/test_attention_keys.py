"""Attention written by hand: the key projection is found from the traced model
(``attention_keys.py``) and expanded under ``weight_sharing='auto'``.

The analysis says a layer is a key when shifting its output by a vector constant over its
positions cannot change the model's output. Each case checks that claim against numbers: the
layer's output cotangents summed over each example's positions (what K-FAC-reduce builds ``G``
from) vanish for the layers found, and not for the others. Float64.
"""

import flax.linen as nn
from flax import nnx
from flax.linen.attention import dot_product_attention_weights
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import thor_optax.flax
import thor_optax.nnx
from thor_optax._src import attention_keys

import public_models
import reference
from reference import float64_mode, randn, softmax_ce  # pylint: disable=unused-import

pytestmark = pytest.mark.usefixtures("fast_compiles")

N, T, D, H = 3, 5, 8, 2
MASK = np.random.default_rng(0).random((N, T)) > 0.3
MASK[:, 0] = True  # every example keeps a key


def _heads(t):
  return t.reshape(t.shape[:2] + (H, D // H))


def _mix(w, v):
  return jnp.einsum("nhqk,nkhd->nqhd", w, _heads(v)).reshape(v.shape)


def _logits(q, k):
  return jnp.einsum("nqhd,nkhd->nhqk", _heads(q), _heads(k)) / np.sqrt(D // H)


def _rope(k):
  angle = np.arange(T)[:, None] * np.arange(1, D + 1)[None] * 0.3
  return k * np.cos(angle) + jnp.roll(k, 1, -1) * np.sin(angle)


def _normalized(k):
  return (k - k.mean(-1, keepdims=True)) / jnp.sqrt(k.var(-1, keepdims=True) + 1e-6)


@jax.custom_vjp
def _straight_through_round(x):
  return jnp.round(x)


_straight_through_round.defvjp(lambda x: (jnp.round(x), None), lambda _, g: (g,))


@jax.custom_jvp
def _hard_max(x):  # a one-hot argmax whose derivative is the softmax's (straight through)
  return jax.nn.one_hot(jnp.argmax(x, -1), x.shape[-1], dtype=x.dtype)


_hard_max.defjvp(lambda primals, tangents: (_hard_max(primals[0]), jax.jvp(
    jax.nn.softmax, primals, tangents)[1]))


def _attend(q, k, v):
  return _mix(jax.nn.softmax(_logits(q, k)), v)


def _delta_over_positions(u):
  """``u_t - u_{t-1}`` by a scan over the positions (``u_{-1} = 0``)."""
  _, ys = jax.lax.scan(lambda prev, x: (x, x - prev), jnp.zeros_like(u[:, 0]), u.swapaxes(0, 1))
  return ys.swapaxes(0, 1)


# Each style: attention of projections (q, k, v) -> (N, T, D), and which of them is a key.
STYLES = {
    "flax_weights": (lambda q, k, v: _mix(dot_product_attention_weights(
        _heads(q), _heads(k), mask=MASK[:, None, None, :]), v), {"k"}),
    "jax_nn_xla": (lambda q, k, v: jax.nn.dot_product_attention(
        _heads(q), _heads(k), _heads(v), mask=MASK[:, None, None, :],
        implementation="xla").reshape(q.shape), {"k"}),
    "log_softmax": (lambda q, k, v: _mix(jnp.exp(jax.nn.log_softmax(_logits(q, k))), v), {"k"}),
    "finfo_min_bias": (lambda q, k, v: _mix(jax.nn.softmax(_logits(q, k) + jax.lax.select(
        MASK, jnp.zeros((N, T)), jnp.full((N, T), jnp.finfo(jnp.float64).min))[
            :, None, None, :]), v), {"k"}),
    # DeepMind's Perceiver writes the fill as -large_k, large_k = jnp.array(1e30).
    "negated_fill": (lambda q, k, v: _mix(jax.nn.softmax(jnp.where(
        MASK[:, None, None, :], _logits(q, k), -jnp.array(1e30))), v), {"k"}),
    "bert_additive_mask": (lambda q, k, v: _mix(jax.nn.softmax(
        _logits(q, k) + (1.0 - MASK[:, None, None, :]) * -10000.0), v), {"k"}),
    # Not keys: the shift changes the output.
    "rope": (lambda q, k, v: _mix(jax.nn.softmax(_logits(q, _rope(k))), v), set()),
    "qk_norm": (lambda q, k, v: _mix(jax.nn.softmax(_logits(q, _normalized(k))), v), set()),
    "zero_fill": (lambda q, k, v: _mix(jax.nn.softmax(jnp.where(
        MASK[:, None, None, :], _logits(q, k), 0.0)), v), set()),
    "sigmoid": (lambda q, k, v: _mix(jax.nn.sigmoid(_logits(q, k)), v), set()),
    # The key also reaches the output through a straight-through round (a custom_vjp whose
    # primal has a zero derivative, whose cotangents pass).
    "straight_through": (lambda q, k, v: _attend(q, k, v) + 0.1 * _straight_through_round(k),
                         set()),
    # Its derivative is the custom rule's (the softmax's): the query moves the output.
    "hard_attention": (lambda q, k, v: _mix(_hard_max(_logits(q, k)), v), set()),
    # An optimization barrier passes each operand's tangent to its own output.
    "barrier": (lambda q, k, v: _attend(*jax.lax.optimization_barrier((q, k, v))), {"k"}),
    # The first iteration's difference is the shift itself.
    "scan_delta": (lambda q, k, v: _attend(q, k, v) + 0.1 * _delta_over_positions(k), set()),
    # One branch cancels the shift, the other does not.
    "cond": (lambda q, k, v: _attend(q, k, v) + 0.1 * (k - jax.lax.cond(
        jnp.sum(q) > 0, lambda u: u, jnp.zeros_like, k)), set()),
    # Two layouts of the key flattened alike are not the same vector.
    "reshape_layouts": (lambda q, k, v: _attend(q, k, v) + 0.1 * (
        k.reshape(N, T * D) - k.swapaxes(1, 2).reshape(N, D * T)).reshape(N, T, D), set()),
}


# Keys the analysis does not find (safe: reduced, as before): a custom rule is not followed.
MISSED = {("hard_attention", "k")}


def _model(style, marks=None):
  """``f(x, kernels, perts)``: three projections (a fused one for ``'fused'``), each output
  plus its perturbation, through the style's attention, pooled over the positions."""
  attend = STYLES[style if style != "fused" else "flax_weights"][0]

  def f(x, kernels, perts):
    if style == "fused":
      qkv = x @ kernels["qkv"] + perts["qkv"]
      if marks is not None:
        qkv = marks.mark(qkv, ("qkv",), (1,))
      q, k, v = jnp.split(qkv, 3, axis=-1)
    else:
      q, k, v = (x @ kernels[n] + perts[n] for n in "qkv")
      if marks is not None:
        q, k, v = (marks.mark(t, (n,), (1,)) for t, n in zip((q, k, v), "qkv"))
    return jnp.tanh(attend(q, k, v)).mean(1)

  return f


@pytest.mark.parametrize("style", sorted(STYLES) + ["fused"])
def test_keys_found_are_those_whose_summed_cotangents_vanish(style):
  """Before, ``hard_attention``, ``scan_delta``, ``cond`` and ``reshape_layouts`` took the key
  (or the query) for a key and ``barrier`` the value; ``negated_fill``'s key was missed."""
  x = jnp.asarray(randn(0, (N, T, D)))
  names = ("qkv",) if style == "fused" else tuple("qkv")
  width = 3 * D if style == "fused" else D
  kernels = {n: jnp.asarray(randn(1 + i, (D, width))) for i, n in enumerate(names)}
  perts = {n: jnp.zeros((N, T, width)) for n in names}
  marks = attention_keys.Marks()
  closed = jax.make_jaxpr(_model(style, marks))(x, kernels, perts)
  found = {p[0] for p in attention_keys.shift_invariant(closed.jaxpr, [True], marks)}
  assert found == (set() if style == "fused" else STYLES[style][1])

  out, vjp = jax.vjp(lambda p: _model(style)(x, kernels, p), perts)
  cotangents = vjp(jnp.asarray(randn(9, out.shape)))[0]
  for name in names:
    g = np.asarray(cotangents[name])
    summed = np.abs(g.sum(1)).max() / np.abs(g).max()
    if name in found:  # jax.nn.dot_product_attention takes its softmax in float32
      assert summed < (1e-6 if style == "jax_nn_xla" else 1e-12), name
    elif (style, name) in MISSED:
      assert summed < 1e-12, name
    else:
      assert summed > 1e-3, name


class SelfAttention(nn.Module):
  """Self-attention written as Hugging Face's Flax models write it: ``nn.Dense`` query, key and
  value, Flax's ``dot_product_attention_weights`` with an additive ``finfo.min`` mask bias."""

  @nn.compact
  def __call__(self, h, mask):
    q, k, v = (nn.Dense(D, name=n)(h) for n in ("query", "key", "value"))
    bias = jax.lax.select(mask > 0, jnp.zeros(mask.shape), jnp.full(mask.shape, -1e30))
    w = dot_product_attention_weights(_heads(q), _heads(k), bias=bias[:, None, None, :])
    return h + nn.Dense(D, name="out")(_mix(w, v))


class Block(nn.Module):
  """One attention block as a scan body: ``(carry, mask) -> (carry, None)``."""

  @nn.compact
  def __call__(self, h, mask):
    return SelfAttention(name="attn")(h, mask), None


class Classifier(nn.Module):
  """Two attention blocks, unrolled or ``nn.scan`` over ``nn.remat`` (a stack), pooled to a
  per-example loss (``'auto'``: reduce, the keys expanded)."""
  scanned: bool = False

  @nn.compact
  def __call__(self, x, mask):
    h = nn.Dense(D, name="embed")(x)
    if self.scanned:
      h, _ = nn.scan(nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True},
                     in_axes=nn.broadcast, length=2)(name="blocks")(h, mask)
    else:
      for i in range(2):
        h = SelfAttention(name=f"attn_{i}")(h, mask)
    return nn.Dense(4, name="head")(h.mean(1))


@pytest.mark.parametrize("scanned", [False, True])
def test_auto_expands_the_key_of_attention_written_by_hand(scanned):
  """Before: every projection was reduced, the key's ``G`` vanished (its summed cotangents are
  zero) and the key kept the identity for ``G``. Now ``'auto'``'s statistics equal the
  all-expand capture's for the keys and the all-reduce capture's for every other layer."""
  x = jnp.asarray(randn(3, (N, T, 6)))
  y = jnp.arange(N) % 4
  mask = jnp.asarray(MASK, jnp.float64)
  model = Classifier(scanned)
  params = reference.init_params(model, x, mask)
  stats = {sharing: reference.capture(model, softmax_ce, weight_sharing=sharing)(
      params, x, y, mask=mask)[1].layers for sharing in ("auto", "expand", "reduce")}
  keys = [("blocks", "attn", "key")] if scanned else [(f"attn_{i}", "key") for i in range(2)]
  for path in keys:  # reduce's cotangents of the key, summed over the positions, vanish
    assert float(jnp.abs(_at(stats["reduce"], path).cotangents).max()) < 1e-12
  flat = {s: dict(jax.tree_util.tree_flatten_with_path(t)[0]) for s, t in stats.items()}
  for path, got in flat["auto"].items():
    is_key = any(getattr(k, "key", None) == "key" for k in path)
    want = flat["expand" if is_key else "reduce"][path]
    assert got.shape == want.shape, jax.tree_util.keystr(path)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-13,
                               err_msg=jax.tree_util.keystr(path))
  assert sum(any(getattr(k, "key", None) == "key" for k in path) for path in flat["auto"]) == (
      2 * len(keys))  # inputs and cotangents of each key


def _at(tree, path):
  for key in path:
    tree = tree[key]
  return tree


class NnxSelfAttention(nnx.Module):
  """The same attention in NNX, pooled to a per-example loss."""

  def __init__(self, rngs):
    self.query, self.key, self.value = (nnx.Linear(D, D, rngs=rngs) for _ in range(3))
    self.head = nnx.Linear(D, 4, rngs=rngs)

  def __call__(self, h):
    w = dot_product_attention_weights(_heads(self.query(h)), _heads(self.key(h)))
    return self.head(_mix(w, self.value(h)).mean(1))


class NnxBlock(nnx.Module):
  """A residual attention block with the attention of :class:`NnxSelfAttention`."""

  def __init__(self, rngs):
    self.query, self.key, self.value = (nnx.Linear(D, D, rngs=rngs) for _ in range(3))

  def __call__(self, h):
    return h + _mix(dot_product_attention_weights(_heads(self.query(h)), _heads(self.key(h))),
                    self.value(h))


class NnxScanned(nnx.Module):
  """Two :class:`NnxBlock` made by ``nnx.vmap`` and run by ``nnx.scan`` straight on the input
  (no layer before the loop), pooled to a per-example loss."""

  def __init__(self, rngs):
    @nnx.split_rngs(splits=2)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return NnxBlock(rngs)

    self.blocks, self.head = make(rngs), nnx.Linear(D, 4, rngs=rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def forward(h, block):
      return block(h)

    return self.head(forward(x, self.blocks).mean(1))


def test_nnx_auto_expands_the_key_of_attention_written_by_hand():
  """Also in an ``nnx.scan`` stack whose loop receives no tangent from outside (the marks
  inside its body were not seen, and the keys were reduced)."""
  x = jnp.asarray(randn(4, (N, T, D)))
  (_, _), stats = thor_optax.nnx.value_and_grad_with_stats(softmax_ce)(
      NnxSelfAttention(nnx.Rngs(0)), x, jnp.arange(N) % 4)
  assert stats.layers["key"].cotangents.shape == (1, N, T, D)
  for name in ("query", "value"):
    assert stats.layers[name].cotangents.shape == (1, N, D)
  (_, _), stats = thor_optax.nnx.value_and_grad_with_stats(softmax_ce)(
      NnxScanned(nnx.Rngs(0)), x, jnp.arange(N) % 4)
  assert stats.layers["blocks"]["key"].cotangents.shape == (2, 1, N, T, D)
  for name in ("query", "value"):
    assert stats.layers["blocks"][name].cotangents.shape == (2, 1, N, D)


class FlaxBlock(nn.Module):
  """``nn.MultiHeadDotProductAttention`` with a causal mask, as a scan body."""

  @nn.compact
  def __call__(self, h, _):
    mask = nn.make_causal_mask(jnp.ones(h.shape[:-1], jnp.int32))
    return h + nn.MultiHeadDotProductAttention(num_heads=H, name="attn")(h, mask=mask), None


class ScannedFlaxAttention(nn.Module):

  @nn.compact
  def __call__(self, x):
    h, _ = nn.scan(FlaxBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                   length=2)(name="blocks")(nn.Dense(D)(x), None)
    return nn.Dense(4)(h.mean(1))


def test_flax_attention_in_a_scan_whose_body_jax_prunes():
  """JAX prunes a copy of this loop body, dropping a marked output there: the analysis skips
  that mark (it has no output to start from); the keys stay expanded, the other projections
  reduced."""
  x = jnp.asarray(randn(5, (N, T, 6)))
  model = ScannedFlaxAttention()
  params = reference.init_params(model, x)
  _, stats = jax.eval_shape(thor_optax.flax.value_and_grad_with_stats(model, softmax_ce),
                            params, x, jnp.arange(N) % 4)
  attn = stats.layers["blocks"]["attn"]
  assert attn["key"].cotangents.shape == (2, 1, N, T, D)
  assert attn["query"].cotangents.shape == (2, 1, N, D)


def test_bert_style_public_model_expands_its_key_only():
  """The public-style BERT classifier (``public_models.py``): its hand-written attention's key
  is expanded, every other sequence layer reduced (a per-example loss)."""
  case = public_models.LINEN_MODELS["bert_classifier"]
  batch, labels = case.make_batch()
  n, t = batch["input_ids"].shape
  params = jax.eval_shape(lambda: case.model.init(jax.random.key(0), batch))["params"]
  _, stats = jax.eval_shape(thor_optax.flax.value_and_grad_with_stats(case.model, case.loss_fn),
                            params, batch, labels)
  assert stats.layers["key"].cotangents.shape == (1, n, t, 16)
  for name in ("query", "value", "attention_out", "intermediate", "output"):
    assert stats.layers[name].cotangents.shape[:2] == (1, n), name
    assert stats.layers[name].cotangents.ndim == 3, name  # (S, N, d): positions reduced


def test_bfloat16_attention_finds_the_key_only():
  """A model computing in bfloat16 (``np.issubdtype`` does not count it as floating point):
  every tangent was dropped and every projection taken for a key."""
  marks = attention_keys.Marks()
  x = jnp.asarray(randn(0, (N, T, D)), jnp.bfloat16)
  kernels = {n: jnp.asarray(randn(1 + i, (D, D)), jnp.bfloat16) for i, n in enumerate("qkv")}
  perts = {n: jnp.zeros((N, T, D), jnp.bfloat16) for n in "qkv"}
  closed = jax.make_jaxpr(_model("flax_weights", marks))(x, kernels, perts)
  assert attention_keys.shift_invariant(closed.jaxpr, [True], marks) == {("k",)}


def test_a_layer_applied_to_its_own_output_is_not_a_key():
  """``k = L(P L(h))``: the second call's input moves with the first call's shift (the mark of
  the second call replaced that tangent)."""
  x = jnp.asarray(randn(0, (N, T, D)))
  mixing = jnp.asarray(randn(1, (T, T)))
  kernels = {n: jnp.asarray(randn(2 + i, (D, D))) for i, n in enumerate("qkv")}

  def f(x, perts, marks=None):
    def layer(h, name, use):
      out = h @ kernels[name] + perts[name][use]
      return out if marks is None else marks.mark(out, (name,), (1,))
    k = layer(jnp.einsum("st,ntd->nsd", mixing, layer(x, "k", 0)), "k", 1)
    return jnp.tanh(_attend(layer(x, "q", 0), k, layer(x, "v", 0))).mean(1)

  perts = {n: jnp.zeros((2, N, T, D)) for n in "qkv"}
  marks = attention_keys.Marks()
  closed = jax.make_jaxpr(lambda x, p: f(x, p, marks))(x, perts)
  assert not attention_keys.shift_invariant(closed.jaxpr, [True], marks)
  out, vjp = jax.vjp(lambda p: f(x, p), perts)
  g = np.asarray(vjp(jnp.asarray(randn(9, out.shape)))[0]["k"])
  assert np.abs(g.sum((0, 2))).max() > 1e-3 * np.abs(g).max()  # both uses' positions


class NormalizedQK(nn.Module):
  """``nn.MultiHeadDotProductAttention(normalize_qk=True)`` pooled to a per-example loss: a
  LayerNorm on the keys, so a shift of the key projection changes the logits."""

  @nn.compact
  def __call__(self, x):
    h = nn.MultiHeadDotProductAttention(num_heads=H, qkv_features=D, normalize_qk=True,
                                        name="attn")(x)
    return nn.Dense(4, name="head")(h.mean(1))


def test_flax_attention_with_normalized_keys_reduces_its_key():
  """Its key projection was expanded by name; its summed cotangents do not vanish."""
  x = jnp.asarray(randn(6, (N, T, D)))
  model = NormalizedQK()
  params = reference.init_params(model, x)
  stats = {sharing: reference.capture(model, softmax_ce, weight_sharing=sharing)(
      params, x, jnp.arange(N) % 4)[1] for sharing in ("auto", "reduce")}
  key = stats["auto"].layers["attn"]["key"]
  assert key.cotangents.shape == (1, N, D)  # reduced
  assert float(jnp.abs(stats["reduce"].layers["attn"]["key"].cotangents).max()) > 1e-3


class SharedKey(nn.Module):
  """The key projection also applied to the pooled sequence: that use has no positions, and
  its shift (the same ``c``) reaches the output."""

  @nn.compact
  def __call__(self, x):
    key = nn.Dense(D, name="key")
    q, v = nn.Dense(D, name="query")(x), nn.Dense(D, name="value")(x)
    return nn.Dense(4, name="head")(_attend(q, key(x), v).mean(1) + key(x.mean(1)))


class GridKey(nn.Module):
  """One projection applied to a grid ``(N, A, B, D)`` used as keys, then to ``(N, T, D)``
  under a softmax over its features: the second call's axes are not the first's."""

  @nn.compact
  def __call__(self, x):
    proj = nn.Dense(D, name="proj")
    grid = x[:, :4, :].reshape(N, 2, 2, D)
    q, v = nn.Dense(D, name="query")(x[:, :4]), nn.Dense(D, name="value")(x[:, :4])
    attended = _attend(q, proj(grid).reshape(N, 4, D), v)
    return nn.Dense(4, name="head")(attended.mean(1) + jax.nn.log_softmax(proj(x)).mean(1))


class Member(nn.Module):
  """An ensemble member with a softmax over the examples of the batch."""

  @nn.compact
  def __call__(self, h):
    return h + jax.nn.softmax(nn.Dense(D, name="gate")(h), axis=0) * nn.Dense(D, name="value")(h)


class Ensemble(nn.Module):
  """``nn.vmap`` over two members: the jaxpr's outputs of their layers have the ensemble axis
  in front, so the members' positions are one axis later than in the call."""

  @nn.compact
  def __call__(self, x):
    out = nn.vmap(Member, variable_axes={"params": 0}, split_rngs={"params": True},
                  in_axes=None, out_axes=0, axis_size=2)(name="ens")(x)
    return nn.Dense(4, name="head")(out.mean((0, 2)))


@pytest.mark.parametrize("model,path", [(SharedKey(), ("key",)), (GridKey(), ("proj",)),
                                        (Ensemble(), ("ens", "gate"))])
def test_layers_whose_summed_cotangents_do_not_vanish_are_reduced(model, path):
  """Three layers taken for keys before: a shared layer with a use without positions (only
  the others were shifted), a shared layer whose calls have different ranks (the first call's
  positions were used for both), and a layer under ``nn.vmap`` (shifted along the examples)."""
  x = jnp.asarray(randn(7, (N, T, D)))
  y = jnp.arange(N) % 4
  params = reference.init_params(model, x)
  auto, reduce = (reference.capture(model, softmax_ce, weight_sharing=s)(params, x, y)[1]
                  for s in ("auto", "reduce"))
  assert _at(auto.layers, path).cotangents.shape == _at(reduce.layers, path).cotangents.shape
  assert float(jnp.abs(_at(reduce.layers, path).cotangents).max()) > 1e-3


def _verdict_and_sums(f, args, perts):
  """The analysis's keys of ``f(*args, perts, marks)`` and the ``k`` perturbation's cotangents
  summed over its positions (axis 1) relative to their size."""
  marks = attention_keys.Marks()
  closed = jax.make_jaxpr(lambda *a: f(*a, marks))(*args, perts)
  g = np.asarray(jax.grad(lambda p: jnp.sum(jnp.sin(f(*args, p))))(perts)["k"])
  return (attention_keys.shift_invariant(closed.jaxpr, [True], marks),
          np.abs(g.sum(1)).max() / np.abs(g).max())


def test_a_vmap_whose_mapped_axis_is_not_in_front_is_not_taken_for_a_key():
  """``jax.vmap(in_axes=2, out_axes=2)`` keeps the mapped axis in place in the jaxpr, and with
  every size equal the shift was put along it (a softmax over the mapped axis cancelled it)."""
  x = jnp.asarray(randn(0, (3, 3, 3, 4)))
  kernel, values = jnp.asarray(randn(1, (4, 4))), jnp.asarray(randn(2, (3, 3, 3, 4)))

  def f(x, perts, marks=None):
    def layer(h, p):
      y = h @ kernel + p  # one call: (N, T, D), positions (1,)
      return y if marks is None else marks.mark(y, ("k",), (1,))
    y = jax.vmap(layer, in_axes=(2, 2), out_axes=2)(x, perts["k"])
    return (jax.nn.softmax(y, axis=2) * values).sum(2).mean(1)

  found, summed = _verdict_and_sums(f, (x,), {"k": jnp.zeros((3, 3, 3, 4))})
  assert not found and summed > 1e-3


def test_a_shard_map_body_is_not_entered():
  """Inside ``shard_map`` the example axis is one device's (size 1, taken as constant), so a
  shift differing between examples looked like one ``c`` for all and cancelled."""
  mesh = jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:2])
  x, kernel = jnp.asarray(randn(0, (2, T, D))), jnp.asarray(randn(1, (D, D)))

  def f(x, perts, marks=None):
    def body(h, p):
      y = h @ kernel + p
      return y if marks is None else marks.mark(y, ("k",), (1,))
    y = jax.shard_map(body, mesh=mesh, in_specs=(jax.P("x"), jax.P("x")),
                      out_specs=jax.P("x"))(x, perts["k"])
    return jnp.tanh(y[0] - y[1])

  found, summed = _verdict_and_sums(f, (x,), {"k": jnp.zeros((2, T, D))})
  assert not found and summed > 1e-3
