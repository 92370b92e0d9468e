"""Weight sharing: one layer's weights used several times in a forward pass (a layer called
twice, a tied embedding's lookup and ``attend``) get one curvature from all uses.

K-FAC-expand (Eschenhagen et al., NeurIPS 2023): the uses are positions sharing the weight, so
their rows join the layer's factors; K-FAC-reduce: per example, inputs averaged and cotangents
summed over them. References: the uses' inputs and output cotangents computed by hand (explicit
perturbations of a hand-written forward pass), explicit Kronecker products, and the exact
Gauss-Newton matrix of a deep linear network. Float64.
"""

import warnings

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

N, T, V, D, K = 3, 4, 7, 5, 3
DAMPING = 0.01
S = np.sqrt(DAMPING)  # the damping added to each factor


class Twice(nn.Module):
  """One dense layer applied to ``x`` and ``2 x``, the two branches summed."""

  @nn.compact
  def __call__(self, x):
    shared = nn.Dense(4, name="shared")
    return nn.Dense(K, name="head")(jnp.tanh(shared(x)) + jnp.tanh(shared(2.0 * x)))


def _update(model, params, x, y, loss_fn, **capture_kwargs):
  (_, grads), stats = reference.capture(model, loss_fn, **capture_kwargs)(params, x, y)
  tx = thor_optax.scale_by_kfac(DAMPING, ema_decay=None)
  updates, _ = tx.update(grads, tx.init(params), params, curvature_stats=stats)
  return updates, grads, stats


def test_a_layer_called_twice_expands_over_its_calls():
  x = jnp.asarray(randn(0, (N, 6)))
  y = jnp.arange(N) % K
  params = reference.init_params(Twice(), x)
  updates, grads, stats = _update(Twice(), params, x, y, softmax_ce, weight_sharing="expand")
  assert not stats.unhandled

  def forward(e1, e2):  # the model by hand, with a perturbation of each call's output
    w, b = params["shared"]["kernel"], params["shared"]["bias"]
    h = jnp.tanh(x @ w + b + e1) + jnp.tanh(2.0 * x @ w + b + e2)
    return h @ params["head"]["kernel"] + params["head"]["bias"]

  zeros = jnp.zeros((N, 4))
  g1, g2 = jax.grad(lambda e1, e2: N * softmax_ce(forward(e1, e2), y), (0, 1))(zeros, zeros)
  a = np.concatenate([np.asarray(x), 2.0 * np.asarray(x)])
  a = np.concatenate([a, np.ones((2 * N, 1))], axis=1)
  g = np.concatenate([np.asarray(g1), np.asarray(g2)])
  A, G = a.T @ a / N, g.T @ g / (2 * N)  # expand: A over N examples, G over their 2N rows
  grad = reference.stacked({k: np.asarray(v) for k, v in grads["shared"].items()})
  want = reference.kron_update(A, G, grad, S, S)
  np.testing.assert_allclose(reference.stacked(updates["shared"]), want, rtol=0, atol=1e-12)


def test_reduce_is_exact_for_shared_weights_summed_before_the_loss():
  """``(x1 + x2) W`` written as one bias-less layer applied to ``x1`` and ``x2`` and summed:
  K-FAC-reduce (``'auto'`` here, a loss per example) gives the exact Gauss-Newton block
  ``(1/N) sum (x1 + x2)(x1 + x2)^T (x) I`` as ``A = (1/N) sum a_bar a_bar^T`` with the mean
  input ``a_bar = (x1 + x2) / 2`` and ``G = 4 I`` (the summed cotangents ``2 e``)."""

  class Summed(nn.Module):

    @nn.compact
    def __call__(self, x):
      layer = nn.Dense(K, use_bias=False, name="w")
      return layer(x[:, 0]) + layer(x[:, 1])

  x = jnp.asarray(randn(1, (N, 2, 6)))
  y = jnp.asarray(randn(2, (N, K)))
  params = reference.init_params(Summed(), x)
  updates, grads, stats = _update(Summed(), params, x, y, squared_error, fisher_type="exact",
                                  likelihood="squared_error")
  assert stats.layers["w"].inputs.shape == (N, 6)
  xs = np.asarray(x).sum(1)
  hessian = jax.hessian(lambda w: squared_error(Summed().apply({"params": {"w": {
      "kernel": w}}}, x), y))(params["w"]["kernel"]).reshape(6 * K, 6 * K)
  np.testing.assert_allclose(np.kron(xs.T @ xs / N, np.eye(K)), hessian, rtol=0, atol=1e-13)
  A, G = (xs / 2).T @ (xs / 2) / N, 4.0 * np.eye(K)
  want = reference.kron_update(A, G, np.asarray(grads["w"]["kernel"]), S, S)
  np.testing.assert_allclose(updates["w"]["kernel"], want, rtol=0, atol=1e-12)


class TiedLM(nn.Module):
  """Embedding lookup, a dense mixing layer, logits by the embedding's ``attend``."""

  @nn.compact
  def __call__(self, ids):
    emb = nn.Embed(V, D, name="emb")
    return emb.attend(jnp.tanh(nn.Dense(D, name="mix")(emb(ids))))


def _tied_reference(params, ids, y):
  """The tied embedding's update by hand: ``A`` diagonal (token counts plus squared logit
  cotangents, over the ``M = N T`` loss terms), ``G`` over the lookups' cotangents and the
  ``attend`` inputs (``2 N T`` rows)."""
  emb, mix = params["emb"]["embedding"], params["mix"]

  def forward(e_lookup, e_logits):
    h = jnp.tanh((emb[ids] + e_lookup) @ mix["kernel"] + mix["bias"])
    return h @ emb.T + e_logits, h

  def loss(e1, e2):
    return N * T * softmax_ce(forward(e1, e2)[0], y)  # per-term cotangents: M = N T

  g_e, g_l = jax.grad(loss, (0, 1))(jnp.zeros((N, T, D)), jnp.zeros((N, T, V)))
  h = np.asarray(forward(jnp.zeros((N, T, D)), jnp.zeros((N, T, V)))[1]).reshape(-1, D)
  counts = np.bincount(np.asarray(ids).reshape(-1), minlength=V)
  g_l = np.asarray(g_l).reshape(-1, V)
  a_diag = (counts + (g_l ** 2).sum(0)) / (N * T)
  rows = np.concatenate([np.asarray(g_e).reshape(-1, D), h])
  G = rows.T @ rows / (2 * N * T)
  grad = np.asarray(jax.grad(lambda e: softmax_ce(TiedLM().apply(
      {"params": {**params, "emb": {"embedding": e}}}, ids), y))(emb))
  return reference.kron_update(np.diag(a_diag), G, grad, S, S)


def _assert_tied_update(model):
  """``model`` (parameters as :class:`TiedLM`'s) is updated as the hand-made tied reference."""
  ids = jnp.asarray(np.random.default_rng(0).integers(0, V, (N, T)))
  y = jnp.asarray(np.random.default_rng(1).integers(0, V, (N, T)))
  params = reference.init_params(TiedLM(), ids)
  updates, _, stats = _update(model, params, ids, y, softmax_ce)
  assert not stats.unhandled
  assert stats.layers["emb"].attend_inputs.shape == (N * T, 1, D)
  np.testing.assert_allclose(updates["emb"]["embedding"], _tied_reference(params, ids, y),
                             rtol=0, atol=1e-12)


def test_tied_embedding_joins_lookup_and_attend():
  _assert_tied_update(TiedLM())


def test_nnx_tied_embedding_matches_linen():
  ids = jnp.asarray(np.random.default_rng(0).integers(0, V, (N, T)))
  y = jnp.asarray(np.random.default_rng(1).integers(0, V, (N, T)))
  params = reference.init_params(TiedLM(), ids)

  class Model(nnx.Module):

    def __init__(self):
      self.emb = nnx.Embed(V, D, param_dtype=jnp.float64, rngs=nnx.Rngs(0))
      self.mix = nnx.Linear(D, D, param_dtype=jnp.float64, rngs=nnx.Rngs(1))

    def __call__(self, ids):
      return self.emb.attend(jnp.tanh(self.mix(self.emb(ids))))

  model = Model()
  nnx.update(model, nnx.State(params))
  (_, grads), stats = thor_optax.nnx.value_and_grad_with_stats(softmax_ce)(model, ids, y)
  assert not stats.unhandled
  tx = thor_optax.scale_by_kfac(DAMPING, ema_decay=None)
  got, _ = tx.update(grads, tx.init(nnx.state(model, nnx.Param)), curvature_stats=stats)
  np.testing.assert_allclose(nnx.to_pure_dict(nnx.State(got))["emb"]["embedding"],
                             _tied_reference(params, ids, y), rtol=0, atol=1e-12)


class OwnTable(nn.Module):
  """A table of one's own, ``wte``, looked up in ``__call__`` (the ``'lookup'`` kind)."""

  @nn.compact
  def __call__(self, ids):
    return self.param("wte", nn.initializers.normal(1.0), (V, D))[ids]


class HFTiedLM(nn.Module):
  """:class:`TiedLM` as Hugging Face's Flax LM heads write it: the logits from ``nn.Dense(V,
  use_bias=False)`` applied with ``.apply()`` to the table transposed (``FlaxGPT2LMHeadModule``,
  ``FlaxBertLMPredictionHead``), the table read as an attribute or from ``self.variables``;
  ``kernel`` says what the head is given instead (listed), ``lookup_after`` looks the ids up
  once more after the head (a third use)."""

  access: str = "attribute"
  table: str = "embed"
  kernel: str = "transposed"
  lookup_after: bool = False

  def setup(self):
    self.emb = nn.Embed(V, D) if self.table == "embed" else OwnTable()
    self.mix = nn.Dense(D)
    self.lm_head = nn.Dense(V, use_bias=self.kernel == "with_bias")
    if self.kernel == "with_bias":
      self.head_bias = self.param("head_bias", nn.initializers.zeros_init(), (V,))

  def __call__(self, ids):
    h = jnp.tanh(self.mix(self.emb(ids)))
    leaf = "embedding" if self.table == "embed" else "wte"
    table = (self.emb.embedding if self.access == "attribute" and self.table == "embed"
             else self.variables["params"]["emb"][leaf])
    head = {"params": {"kernel": table.T}}
    if self.kernel == "scaled":
      head = {"params": {"kernel": 2.0 * table.T}}
    elif self.kernel == "with_bias":
      head["params"]["bias"] = self.head_bias
    logits = self.lm_head.apply(head, h)
    if self.lookup_after:
      logits = logits + self.emb(ids)[..., :1]
    return logits


@pytest.mark.parametrize("access", ["attribute", "variables"])
def test_hugging_face_tied_head_joins_lookup_and_attend(access):
  """``Dense.apply({'params': {'kernel': embedding.T}}, h)`` is the embedding's ``attend``: the
  update equals the hand-made tied reference's (before, the embedding was listed)."""
  _assert_tied_update(HFTiedLM(access))


def test_hugging_face_tied_head_of_a_table_of_ones_own():
  """The same with a table of a module of one's own (``'lookup'`` kind, ``LookupStats``)."""
  ids = jnp.asarray(np.random.default_rng(2).integers(0, V, (N, T)))
  y = jnp.asarray(np.random.default_rng(3).integers(0, V, (N, T)))
  params = reference.init_params(TiedLM(), ids)
  own = {**params, "emb": {"wte": params["emb"]["embedding"]}}
  (_, grads), stats = reference.capture(HFTiedLM(table="own"), softmax_ce)(own, ids, y)
  assert not stats.unhandled
  assert type(stats.layers["emb"]).__name__ == "LookupStats"
  tx = thor_optax.scale_by_kfac(DAMPING, ema_decay=None,
                                layers=thor_optax.captured_layers(stats))
  updates, _ = tx.update(grads, tx.init(own), own, curvature_stats=stats)
  np.testing.assert_allclose(updates["emb"]["wte"], _tied_reference(params, ids, y),
                             rtol=0, atol=1e-12)


def test_hugging_face_tied_head_joins_the_uses_in_call_order():
  """A lookup after the head: three uses, perturbed in the order they run, as ``attend``'s."""
  ids = jnp.asarray(np.random.default_rng(4).integers(0, V, (N, T)))
  y = jnp.asarray(np.random.default_rng(5).integers(0, V, (N, T)))

  class WithAttend(nn.Module):
    @nn.compact
    def __call__(self, ids):
      emb = nn.Embed(V, D, name="emb")
      logits = emb.attend(jnp.tanh(nn.Dense(D, name="mix")(emb(ids))))
      return logits + emb(ids)[..., :1]

  params = reference.init_params(TiedLM(), ids)
  got, _, stats = _update(HFTiedLM(lookup_after=True), params, ids, y, softmax_ce)
  want, _, want_stats = _update(WithAttend(), params, ids, y, softmax_ce)
  assert not stats.unhandled
  for field in ("inputs", "cotangents", "attend_inputs", "attend_cotangents"):
    np.testing.assert_allclose(getattr(stats.layers["emb"], field),
                               getattr(want_stats.layers["emb"], field), rtol=0, atol=1e-13)
  reference.assert_trees_close(got, want)


class InnerNorm(nn.Module):
  """A norm of one's own (the ``'channel_affine'`` kind) over a parameter-free ``nn.LayerNorm``:
  traced alone at capture, its ``LayerNorm`` runs on a variable tree of its own."""

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", nn.initializers.ones_init(), (x.shape[-1],))
    return nn.LayerNorm(use_scale=False, use_bias=False)(x) * scale


class NormedHead(nn.Module):
  hf: bool = True

  def setup(self):
    self.emb, self.norm, self.lm_head = nn.Embed(V, D), InnerNorm(), nn.Dense(V, use_bias=False)

  def __call__(self, ids):
    h = self.norm(self.emb(ids))
    if self.hf:
      return self.lm_head.apply({"params": {"kernel": self.emb.embedding.T}}, h)
    return self.emb.attend(h)


def test_hugging_face_tied_head_after_a_module_traced_alone():
  """The copies the capture traces alone run modules of Flax's kinds on variable trees of their
  own too; they are not the model's ``.apply()`` calls (before, they were counted among them
  and the tied head was taken for another one: the embedding was listed)."""
  ids = jnp.asarray(np.random.default_rng(8).integers(0, V, (N, T)))
  y = jnp.asarray(np.random.default_rng(9).integers(0, V, (N, T)))
  params = reference.init_params(NormedHead(), ids)
  got, _, stats = _update(NormedHead(), params, ids, y, softmax_ce)
  want, _, _ = _update(NormedHead(hf=False), params, ids, y, softmax_ce)
  assert not stats.unhandled and set(stats.layers) == {"emb", "norm"}
  reference.assert_trees_close(got, want)


class SharedStack(nn.Module):
  """A stack given the model's shared embedding as an attribute (T5's ``embed_tokens``)."""

  embed_tokens: nn.Module

  @nn.compact
  def __call__(self, ids):
    return jnp.tanh(nn.Dense(D, name="mix")(self.embed_tokens(ids)))


class T5Style(nn.Module):
  """Hugging Face's T5 / BART layout: one ``shared`` embedding looked up by the encoder and the
  decoder (inputs of different lengths) and tied to the output through ``.apply()``; ``hf=False``
  writes the head as ``shared.attend``."""

  hf: bool = True

  def setup(self):
    self.shared = nn.Embed(V, D)
    self.encoder, self.decoder = SharedStack(self.shared), SharedStack(self.shared)
    self.lm_head = nn.Dense(V, use_bias=False)

  def __call__(self, ids):
    h = self.encoder(ids[:, :T]).mean(1, keepdims=True) + self.decoder(ids[:, T:])
    h = h * D ** -0.5
    if self.hf:
      table = self.shared.variables["params"]["embedding"]
      return self.lm_head.apply({"params": {"kernel": table.T}}, h)
    return self.shared.attend(h)


def test_t5_style_shared_embedding_and_tied_head():
  """Three uses of one table (two lookups of different lengths, the ``.apply()`` head) are
  joined as the same model's lookups and ``attend`` are."""
  ids = jnp.asarray(np.random.default_rng(14).integers(0, V, (N, T + 3)))
  y = jnp.asarray(np.random.default_rng(15).integers(0, V, (N, 3)))
  params = reference.init_params(T5Style(), ids)
  got, _, stats = _update(T5Style(), params, ids, y, softmax_ce)
  want, _, _ = _update(T5Style(hf=False), params, ids, y, softmax_ce)
  assert not stats.unhandled and stats.layers["shared"].attend_inputs is not None
  reference.assert_trees_close(got, want)


class AutoEncoder(nn.Module):
  """A decoder ``Dense.apply`` given the encoder's kernel transposed (tied autoencoder)."""

  @nn.compact
  def __call__(self, x):
    enc = nn.Dense(3, name="enc")
    z = jnp.tanh(enc(x))
    return nn.Dense(x.shape[-1], use_bias=False).apply(
        {"params": {"kernel": enc.variables["params"]["kernel"].T}}, z)


@pytest.mark.parametrize("inner", ["hf_head", "autoencoder"])
def test_an_apply_inside_a_lifted_transform_keeps_its_parameters_listed(inner):
  """A layer applied with ``.apply()`` inside ``nn.remat``: the module whose parameter feeds it
  is listed and its gradient is unchanged (before: the tracers of the remat body escaped the
  data-flow check, and the embedding or encoder was captured from its own use alone, 0.9 off
  its gradient's update)."""

  class Outer(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.remat(HFTiedLM if inner == "hf_head" else AutoEncoder)(name="inner")(x)

  if inner == "hf_head":
    x = jnp.asarray(np.random.default_rng(10).integers(0, V, (N, T)))
    y = jnp.asarray(np.random.default_rng(11).integers(0, V, (N, T)))
    loss, layer = softmax_ce, "emb"
  else:
    x = jnp.asarray(randn(12, (N, 6)))
    y, loss, layer = jnp.asarray(randn(13, (N, 6))), squared_error, "enc"
  params = reference.init_params(Outer(), x)
  (_, grads), stats = reference.capture(Outer(), loss, num_loss_terms=N)(params, x, y)
  reasons = dict(note.split(": ", 1) for note in stats.unhandled)
  assert f"inner/{layer}" in reasons and "outside" in reasons[f"inner/{layer}"], reasons
  want = jax.grad(lambda p: loss(Outer().apply({"params": p}, x), y))(params)
  reference.assert_trees_close(grads, want)


@pytest.mark.parametrize("kernel", ["scaled", "with_bias"])
def test_a_head_given_more_than_the_table_transposed_is_listed(kernel):
  """``2 * embedding.T``, or a head given a bias of its own too: the embedding stays listed
  (weight sharing through ``.apply()``), its gradient unchanged."""
  ids = jnp.asarray(np.random.default_rng(6).integers(0, V, (N, T)))
  y = jnp.asarray(np.random.default_rng(7).integers(0, V, (N, T)))
  model = HFTiedLM(kernel=kernel)
  params = reference.init_params(model, ids)
  (_, grads), stats = reference.capture(model, softmax_ce)(params, ids, y)
  reasons = dict(note.split(": ", 1) for note in stats.unhandled)
  assert "emb" in reasons and ".apply()" in reasons["emb"], reasons
  assert "emb" not in stats.layers
  want = jax.grad(lambda p: softmax_ce(model.apply({"params": p}, ids), y))(params)
  reference.assert_trees_close(grads, want)


class TiedIntoHead(nn.Module):
  """An encoder whose kernel is read again into the input of a later layer (``head``), and a
  ``Dense`` subclass whose own method reads its kernel (``decode``): neither use reaches the
  outputs other than through a registered layer's call."""

  @nn.compact
  def __call__(self, x):

    class Decoding(nn.Dense):
      def decode(self, h):
        return h @ self.variables["params"]["kernel"].T

    enc = nn.Dense(6, name="enc")
    z = jnp.tanh(enc(x))
    tied = Decoding(6, use_bias=False, name="tied")
    rec = tied.decode(jnp.tanh(tied(x)))
    return nn.Dense(K, name="head")(z @ enc.variables["params"]["kernel"].T + rec)


def test_a_parameter_read_into_a_later_layer_is_listed():
  """The forward pass that finds uses outside a layer's calls replaces each call's output by
  zeros that still depend on the call's inputs: a use feeding a later layer is found (before:
  its output was constant zeros, so ``enc`` and ``tied`` were captured, their rows giving a
  wrong gradient). linen and NNX."""
  x = jnp.asarray(randn(0, (N, D)))
  y = jnp.arange(N) % K
  params = reference.init_params(TiedIntoHead(), x)
  (_, _), stats = reference.capture(TiedIntoHead(), softmax_ce)(params, x, y)
  listed, captured = _raw_tied_listed(stats)
  assert listed == {"enc", "tied"} and captured == {"head"}

  class NNXTiedIntoHead(nnx.Module):
    def __init__(self, rngs):
      self.enc = nnx.Linear(D, 6, rngs=rngs)
      self.head = nnx.Linear(D, K, rngs=rngs)

    def __call__(self, x):
      return self.head(jnp.tanh(self.enc(x)) @ self.enc.kernel[...].T)

  (_, _), stats = thor_optax.nnx.value_and_grad_with_stats(softmax_ce)(
      NNXTiedIntoHead(nnx.Rngs(0)), x, y)
  listed, captured = _raw_tied_listed(stats)
  assert listed == {"enc"} and captured == {"head"}


def test_shared_layer_inside_a_lifted_transform_is_listed():
  """A layer called twice inside ``nn.remat`` (which may trace it more than once) stays
  listed, with the reason."""

  class RematTwice(nn.Module):

    @nn.compact
    def __call__(self, x):
      return nn.remat(Twice)(name="body")(x)

  x = jnp.asarray(randn(0, (N, 6)))
  params = reference.init_params(RematTwice(), x)
  (_, _), stats = reference.capture(RematTwice(), softmax_ce)(params, x, jnp.arange(N) % K)
  assert any("body/shared" in note and "lifted transform" in note for note in stats.unhandled)


class RawTied(nn.Module):
  """A tied autoencoder reading its encoder's kernel directly (``enc.variables``) and a tied
  output written ``h @ embedding.T``, next to a scanned, rematerialized stack and a layer used
  once, which stay captured (recurrent cells: ``test_recurrent_layers``)."""

  @nn.compact
  def __call__(self, ids):
    emb = nn.Embed(V, D, name="emb")
    h = emb(ids).mean(axis=1)                                         # (N, D)
    enc = nn.Dense(6, name="enc")
    z = jnp.tanh(enc(h))
    rec = z @ enc.variables["params"]["kernel"].T                     # the raw use

    class Block(nn.Module):
      @nn.compact
      def __call__(self, c, _):
        return c + jnp.tanh(nn.Dense(D, name="dense")(c)), None

    c, _ = nn.scan(nn.remat(Block), variable_axes={"params": 0},
                   split_rngs={"params": True}, length=2)(name="blocks")(rec, None)
    return c @ emb.embedding.T + nn.Dense(V, name="head")(c)          # raw tied output


def _raw_tied_listed(stats):
  listed = {note.split(":")[0] for note in stats.unhandled
            if "used outside the layer's own calls" in note}
  return listed, set(thor_optax.captured_layers(stats).kinds)


def test_a_parameter_read_outside_its_layer_is_listed():
  """A parameter that reaches the outputs other than through its layer's own calls: its
  gradient has a part the layer's rows do not give (a plain step from the rows would drop it)
  and its curvature misses that use, so the layer is listed; layers inside ``nn.scan`` and
  ``nn.remat`` are not taken for shared ones. NNX lists the same."""
  ids = jnp.asarray(np.random.default_rng(0).integers(0, V, (N, T)))
  y = jnp.arange(N) % V
  params = reference.init_params(RawTied(), ids)
  (_, grads), stats = reference.capture(RawTied(), softmax_ce)(params, ids, y)
  listed, captured = _raw_tied_listed(stats)
  assert listed == {"emb", "enc"}
  assert {"blocks/dense", "head"} <= captured and not captured & {"emb", "enc"}
  assert "enc" not in stats.exact_rows
  # A plain step from the rows (capture and update in one jit): the listed layers keep the
  # identity they have (no statistics), so their gradients pass through; the others are taken
  # from their rows (no warning that they fell back to the gradient).
  tx = thor_optax.scale_by_thor(DAMPING, block_size=4)
  capture = thor_optax.flax.value_and_grad_with_stats(RawTied(), softmax_ce)

  def step(params, state, stats_as):
    (_, grads), stats = capture(params, ids, y)
    return tx.update(grads, state, params, **{stats_as: stats}) + (grads,)

  step = jax.jit(step, static_argnums=2)
  with pytest.warns(UserWarning, match=r"no statistics for some layers \(emb: its parameter"):
    _, state, _ = step(params, tx.init(params), "curvature_stats")
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    updates, _, grads = step(params, state, "gradient_stats")
  np.testing.assert_array_equal(updates["enc"]["kernel"], grads["enc"]["kernel"])
  assert not np.allclose(updates["head"]["kernel"], grads["head"]["kernel"])

  class NNXRawTied(nnx.Module):
    def __init__(self, rngs):
      self.emb = nnx.Embed(V, D, rngs=rngs)
      self.enc = nnx.Linear(D, 6, rngs=rngs)
      self.head = nnx.Linear(6, V, rngs=rngs)

    def __call__(self, ids):
      h = self.emb(ids).mean(axis=1)
      z = jnp.tanh(self.enc(h))
      return self.head(z) + (z @ self.enc.kernel[...].T) @ self.emb.embedding[...].T

  (_, _), stats = thor_optax.nnx.value_and_grad_with_stats(softmax_ce)(
      NNXRawTied(nnx.Rngs(0)), ids, y)
  listed, captured = _raw_tied_listed(stats)
  assert listed == {"emb", "enc"} and captured == {"head"}


class WithUnusedCall(nn.Module):
  """big_vision's ViT head: applied to the pooled features (the logits the loss reads) and,
  when ``aux``, to every token too (``logits_2d``, returned beside them for analysis)."""
  aux: bool

  @nn.compact
  def __call__(self, x):
    h = jnp.tanh(nn.Dense(D, name="body")(x))  # (N, T, D)
    head = nn.Dense(K, name="head")
    out = {"logits_2d": head(h)} if self.aux else {}
    return head(h.max(axis=1)), out


class NnxWithUnusedCall(nnx.Module):
  """:class:`WithUnusedCall` in NNX."""

  def __init__(self, aux):
    self.aux = aux
    self.body = nnx.Linear(6, D, param_dtype=jnp.float64, rngs=nnx.Rngs(0))
    self.head = nnx.Linear(D, K, param_dtype=jnp.float64, rngs=nnx.Rngs(1))

  def __call__(self, x):
    h = jnp.tanh(self.body(x))
    return self.head(h.max(axis=1)), ({"logits_2d": self.head(h)} if self.aux else {})


@pytest.mark.parametrize("weight_sharing", ["auto", "expand", "reduce"])
def test_a_call_the_loss_never_reads_is_no_use(weight_sharing):
  """A layer's call whose result the loss never reads is left out of its curvature: the update
  equals the one of the model without that call, linen and NNX. Before, its inputs entered ``A``
  with zero cotangents: the head's update 2x off (0.7x under expand; found by the h_examples
  audit)."""
  x = jnp.asarray(randn(11, (N, T, 6)))
  y = jnp.arange(N) % K
  loss = lambda out, labels: softmax_ce(out[0], labels)
  kwargs = dict(num_loss_terms=N, weight_sharing=weight_sharing)
  params = reference.init_params(WithUnusedCall(True), x)
  got, grads, _ = _update(WithUnusedCall(True), params, x, y, loss, **kwargs)
  want, want_grads, _ = _update(WithUnusedCall(False), params, x, y, loss, **kwargs)
  for a, b in zip(jax.tree.leaves((got, grads)), jax.tree.leaves((want, want_grads))):
    np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)

  def nnx_update(aux):
    model = NnxWithUnusedCall(aux)
    (_, g), stats = thor_optax.nnx.value_and_grad_with_stats(loss, **kwargs)(model, x, y)
    tx = thor_optax.scale_by_kfac(DAMPING, ema_decay=None)
    u, _ = tx.update(g, tx.init(nnx.state(model, nnx.Param)), curvature_stats=stats)
    return nnx.to_pure_dict(nnx.State(u))

  for a, b in zip(jax.tree.leaves(nnx_update(True)), jax.tree.leaves(nnx_update(False))):
    np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
