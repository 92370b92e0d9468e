"""Embedding tables of modules of no Flax class whose call looks rows up by integer ids (the
``'lookup'`` kind): MaxText's / T5X's ``Embed`` (``jnp.asarray(self.embedding, dtype)[inputs]``),
a tutorial's ``jnp.take(self.param('wte', ...), ids, axis=0) * sqrt(d)``, an NNX table.

References are the same models written with ``nn.Embed`` / ``nnx.Embed`` (the constant applied
after it), whose curvature the embedding tests check against dense references; float64. Calls
that are more than the lookup are listed with the reason.
"""

from typing import Any

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest


import thor_optax
import thor_optax.nnx

import reference
from reference import F64, softmax_ce
from reference import float64_mode  # noqa: F401  pylint: disable=unused-import (autouse fixture)

pytestmark = pytest.mark.usefixtures("fast_compiles")

N, T, V, D, K = 5, 6, 11, 4, 3
TRANSFORMS = reference.layout_transforms(0.05)


class MaxTextEmbed(nn.Module):
  """MaxText's ``Embed``: the table ``embedding`` cast to the computation dtype, indexed."""

  @nn.compact
  def __call__(self, inputs):
    embedding = self.param("embedding", nn.initializers.normal(1.0), (V, D), F64)
    return jnp.asarray(embedding, F64)[inputs]


class ScaledTake(nn.Module):
  """A tutorial's: ``jnp.take`` of a table ``wte``, scaled by ``sqrt(d)`` (Gemma's ``encode``
  scale)."""

  @nn.compact
  def __call__(self, tokens):
    wte = self.param("wte", nn.initializers.normal(1.0), (V, D), F64)
    return jnp.take(wte, tokens, axis=0) * jnp.sqrt(D).astype(F64)


class SowsScaledRows(nn.Module):
  """Returns the rows as they are, but sows them scaled (an intermediate the output does not
  read: its constant is not the output's)."""

  @nn.compact
  def __call__(self, ids):
    rows = self.param("wte", nn.initializers.normal(1.0), (V, D), F64)[ids]
    self.sow("intermediates", "scaled", rows * 10.0)
    return rows


class ClippedTake(nn.Module):
  """``jnp.take(..., mode='clip')``: an id out of range reads the nearest row (no wrap of
  negative ids)."""

  @nn.compact
  def __call__(self, ids):
    return jnp.take(self.param("wte", nn.initializers.normal(1.0), (V, D), F64), ids, axis=0,
                    mode="clip")


TABLES = {"maxtext": MaxTextEmbed, "take": ScaledTake, "sows": SowsScaledRows,
          "clip": ClippedTake}


class Net(nn.Module):
  """``embedding -> tanh -> Dense(K)`` per position (a per-token loss); the reference:
  ``nn.Embed`` on ``ids_read(ids)`` times ``scale``."""
  table: str = "reference"
  scale: float = 1.0
  ids_read: Any = None

  @nn.compact
  def __call__(self, ids):
    if self.table in TABLES:
      h = TABLES[self.table](name="emb")(ids)
    else:
      rows = self.ids_read(ids) if self.ids_read else ids
      h = nn.Embed(V, D, name="emb", param_dtype=F64)(rows) * self.scale
    return nn.Dense(K, name="head", param_dtype=F64)(jnp.tanh(h))


def _batch(seed):
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.integers(0, V, (N, T))), jnp.asarray(rng.integers(0, K, (N, T)))


def _as_embed(tree, leaf):
  return {**tree, "emb": {"embedding": tree["emb"][leaf]}}


def _clipped(ids):
  return jnp.clip(ids, 0, V - 1)


@pytest.mark.parametrize("transform", sorted(TRANSFORMS))
@pytest.mark.parametrize("table,leaf,scale,ids_read,stats_type", [
    ("maxtext", "embedding", 1.0, None, "EmbedStats"),
    ("take", "wte", float(np.sqrt(D)), None, "LookupStats"),
    ("sows", "wte", 1.0, None, "LookupStats"),
    ("clip", "wte", 1.0, _clipped, "LookupStats")],
    ids=["maxtext", "scaled_take", "sows_scaled_rows", "clipped_take"])
def test_tables_of_their_own_equal_nn_embed(table, leaf, scale, ids_read, stats_type,
                                             transform):
  """The update of the table equals ``nn.Embed``'s with the same values (the constant after it),
  from the capture's layout and, for a table named ``embedding``, from shapes alone; ``A``
  counts the rows read (a clipping gather's negative ids read row 0: before, counted at the
  wrapped row), and only the output's constant scales the cotangents (before, a sown scaled copy
  scaled them too)."""
  x, y = _batch(0)
  if table == "clip":
    x = x.at[0, :3].set(jnp.asarray([-1, -3, V + 2]))
  params = reference.init_params(Net(table), x)
  got, grads, stats = reference.captured_update(Net(table), params, x, y, softmax_ce,
                                                TRANSFORMS[transform], captured=True)
  assert stats.unhandled == ()
  assert type(stats.layers["emb"]).__name__ == stats_type
  want, _, want_stats = reference.captured_update(
      Net(scale=scale, ids_read=ids_read), _as_embed(params, leaf), x, y, softmax_ce,
      TRANSFORMS[transform])
  reference.assert_trees_close(stats.layers["emb"].cotangents,
                               want_stats.layers["emb"].cotangents)
  reference.assert_trees_close(_as_embed(got, leaf), want)
  assert float(jnp.abs(got["emb"][leaf] - grads["emb"][leaf]).max()) > 1e-3
  if table == "maxtext":
    shapes_only, _, _ = reference.captured_update(Net(table), params, x, y, softmax_ce,
                                                  TRANSFORMS[transform])
    reference.assert_trees_close(shapes_only, got)


class NnxTable(nnx.Module):
  """An NNX table ``tokens`` looked up by indexing its value."""

  def __init__(self, rngs):
    self.tokens = nnx.Param(jax.random.normal(rngs.params(), (V, D), F64))

  def __call__(self, ids):
    return self.tokens[...][ids]


class NnxNet(nnx.Module):

  def __init__(self, rngs, own=True):
    self.emb = NnxTable(rngs) if own else nnx.Embed(V, D, param_dtype=F64, rngs=rngs)
    self.head = nnx.Linear(D, K, param_dtype=F64, rngs=rngs)

  def __call__(self, ids):
    return self.head(jnp.tanh(self.emb(ids)))


def _nnx_update(model, x, y):
  return reference.nnx_captured_update(model, x, y, softmax_ce, TRANSFORMS["kfac"])


def _assert_nnx_equals_embed(net, leaf, x, y):
  """``net(rngs, own=True)``'s update equals ``net(rngs, own=False)``'s (``nnx.Embed``) with
  the same values; returns the capture's statistics."""
  model = net(nnx.Rngs(0))
  got, stats = _nnx_update(model, x, y)
  assert stats.unhandled == ()
  assert type(stats.layers["emb"]).__name__ == "LookupStats"
  own = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  reference_model = net(nnx.Rngs(1), own=False)
  nnx.update(reference_model, nnx.State(_as_embed(own, leaf)))
  want, _ = _nnx_update(reference_model, x, y)
  reference.assert_trees_close(_as_embed(got, leaf), want)
  return stats


def test_nnx_table_of_its_own_equals_nnx_embed():
  _assert_nnx_equals_embed(NnxNet, "tokens", *_batch(1))


class Masked(nn.Module):

  @nn.compact
  def __call__(self, ids):  # padding ids' rows zeroed: the rows times an array of the ids
    table = self.param("embedding", nn.initializers.normal(1.0), (V, D), F64)
    return table[ids] * (ids != 0)[..., None].astype(F64)


class Columns(nn.Module):

  @nn.compact
  def __call__(self, ids):  # a lookup along the features: (D, V)[:, ids]
    table = self.param("embedding", nn.initializers.normal(1.0), (D, V), F64)
    return jnp.moveaxis(table[:, ids], 0, -1)


class Offset(nn.Module):

  @nn.compact
  def __call__(self, ids):  # rows ids + 2 (Hugging Face's BART learned positions): the token
    table = self.param("embedding", nn.initializers.normal(1.0), (V + 2, D), F64)  # counts
    return table[ids + 2]  # of A would be the wrong rows'


class Narrowed(nn.Module):

  @nn.compact
  def __call__(self, ids):  # uint8 ids of a 300-row table: row id % 256 is read
    table = self.param("embedding", nn.initializers.normal(1.0), (300, D), F64)
    return table[ids.astype(jnp.uint8)]


class Transposed(nn.Module):

  @nn.compact
  def __call__(self, ids):  # (N, 1) ids looked up as (1, N): rows in another layout (before:
    table = self.param("embedding", nn.initializers.normal(1.0), (V, D), F64)  # captured, and
    return table[ids.reshape(ids.shape[::-1])]  # the update raised; the model reshapes back)


NOT_A_LOOKUP = {Masked: "multiplies the rows by an array that is not a constant",
                Columns: "not a lookup of rows of it by the ids",
                Offset: "looks rows up by a function of the ids (add)",
                Narrowed: "looks rows up by a function of the ids (convert_element_type)",
                Transposed: "not a lookup of rows of it by the ids"}


@pytest.mark.parametrize("cls", list(NOT_A_LOOKUP), ids=lambda c: c.__name__)
def test_a_call_that_is_more_than_a_lookup_is_listed(cls):

  class Model(nn.Module):
    @nn.compact
    def __call__(self, ids):
      h = cls(name="emb")(ids).reshape(ids.shape + (D,))
      return nn.Dense(K, name="head", param_dtype=F64)(jnp.tanh(h))

  x, y = _batch(2)
  if cls is Transposed:
    x, y = x[:, :1], y[:, :1]
  params = reference.init_params(Model(), x)
  (_, grads), stats = reference.capture(Model(), softmax_ce)(params, x, y)
  assert set(stats.layers) == {"head"}
  (reason,) = stats.unhandled
  assert reason.startswith("emb: ") and NOT_A_LOOKUP[cls] in reason, reason
  want = jax.grad(lambda p: softmax_ce(Model().apply({"params": p}, x), y))(params)
  reference.assert_trees_close(grads, want)


# ------------------------------------------------ tied tables: a lookup and the tied output


class Tied(nn.Module):
  """MaxText's ``Embed`` with its ``attend``, used for the logits (a tied table)."""

  @nn.compact
  def __call__(self, ids):
    return self._table()[ids]

  def attend(self, query):
    return query @ self._table().T

  def _table(self):
    if self.has_variable("params", "embedding"):
      return self.variables["params"]["embedding"]
    return self.param("embedding", nn.initializers.normal(1.0), (V, D), F64)


class GemmaEmbedder(nn.Module):
  """Gemma's ``Embedder``: no ``__call__``; ``encode`` looks up and scales by ``sqrt(d)``,
  ``decode`` is the tied output ``jnp.dot(x, table.T)``; ``rows`` reads no table (no use)."""

  def setup(self):
    self.table = self.param("input_embedding", nn.initializers.normal(1.0), (V, D), F64)

  def encode(self, x):
    x = self.table[(x,)]
    x *= jnp.sqrt(D).astype(x.dtype)
    return x

  def decode(self, x):
    return jnp.dot(x, self.table.T)

  def rows(self, ids):
    return jnp.full(ids.shape, V, F64)


class EinsumDecode(GemmaEmbedder):
  """``decode`` as an einsum of the table itself, halved."""

  def decode(self, x):
    return jnp.einsum("ntd,vd->ntv", x, self.table) * 0.5


class NegatedOffset(GemmaEmbedder):
  """``decode`` negated, a constant bias of the logits added (no use of the table)."""

  def decode(self, x):
    return OFFSET - jnp.dot(x, self.table.T)


OFFSET = np.arange(V) * 0.1  # float64 (NumPy: x64 is enabled by the tests' fixture, after import)


class CallsEncode(GemmaEmbedder):
  """A ``__call__`` that calls ``encode``: one use, not two."""

  def __call__(self, ids):
    return self.encode(ids)


class TiedNet(nn.Module):
  """``lookup -> tanh -> Dense(D) -> tied output``; the reference (``table='reference'``):
  ``nn.Embed`` and its ``attend``, times the constants of the table's module."""

  table: str = "reference"
  scales: tuple = (1.0, 1.0)
  offset: Any = 0.0

  @nn.compact
  def __call__(self, ids):
    if self.table == "reference":
      emb = nn.Embed(V, D, name="emb", param_dtype=F64)
      encode = lambda i: emb(i) * self.scales[0]
      decode = lambda h: emb.attend(h) * self.scales[1] + self.offset
    elif self.table == "maxtext":
      emb = Tied(name="emb")
      encode, decode = emb, emb.attend
    else:
      emb = TIED[self.table](name="emb")
      encode, decode = (emb if self.table == "calls_encode" else emb.encode), emb.decode
    h = encode(ids)
    if self.table == "gemma":
      h = h + 0.0 * emb.rows(ids)[..., None]
    return decode(nn.Dense(D, name="mix", param_dtype=F64)(jnp.tanh(h)))


TIED = {"gemma": GemmaEmbedder, "einsum": EinsumDecode, "calls_encode": CallsEncode,
        "negated_offset": NegatedOffset}


def _tied_batch(seed):
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.integers(0, V, (N, T))), jnp.asarray(rng.integers(0, V, (N, T)))


@pytest.mark.parametrize("transform", sorted(TRANSFORMS))
@pytest.mark.parametrize("table,leaf,scales,stats_type", [
    ("maxtext", "embedding", (1.0, 1.0), "EmbedStats"),
    ("gemma", "input_embedding", (float(np.sqrt(D)), 1.0), "LookupStats"),
    ("einsum", "input_embedding", (float(np.sqrt(D)), 0.5), "LookupStats"),
    ("calls_encode", "input_embedding", (float(np.sqrt(D)), 1.0), "LookupStats"),
    ("negated_offset", "input_embedding", (float(np.sqrt(D)), -1.0), "LookupStats")])
def test_tied_tables_of_their_own_equal_nn_embed_attend(table, leaf, scales, stats_type,
                                                        transform):
  """A table looked up and applied as the tied output by methods of its own module (MaxText's
  ``attend``, Gemma's ``encode`` / ``decode`` with no ``__call__``) is updated as ``nn.Embed``
  with ``attend`` is, its constants folded in; a method reading no table is no use, and a
  ``__call__`` calling ``encode`` is one use. Before, the module was listed."""
  x, y = _tied_batch(3)
  params = reference.init_params(TiedNet(table), x)
  got, grads, stats = reference.captured_update(TiedNet(table), params, x, y, softmax_ce,
                                                TRANSFORMS[transform], captured=True)
  assert stats.unhandled == ()
  emb = stats.layers["emb"]
  assert type(emb).__name__ == stats_type
  assert emb.attend_inputs is not None
  offset = OFFSET if table == "negated_offset" else 0.0
  want, _, want_stats = reference.captured_update(
      TiedNet(scales=scales, offset=offset), _as_embed(params, leaf), x, y, softmax_ce,
      TRANSFORMS[transform])
  for field in ("cotangents", "attend_inputs", "attend_cotangents"):
    reference.assert_trees_close(getattr(emb, field), getattr(want_stats.layers["emb"], field))
  reference.assert_trees_close(_as_embed(got, leaf), want)
  assert float(jnp.abs(got["emb"][leaf] - grads["emb"][leaf]).max()) > 1e-3


def test_a_rematerialized_embedder_is_captured_as_the_plain_one():
  """``nn.remat(Embedder)``: its ``encode`` and ``decode`` (not lifted) run on the class the
  transform makes, which counts as the embedder's (before: taken for a Flax class and listed,
  'module kind not supported')."""

  class Model(nn.Module):
    remat: bool

    @nn.compact
    def __call__(self, ids):
      emb = (nn.remat(GemmaEmbedder) if self.remat else GemmaEmbedder)(name="emb")
      return emb.decode(nn.Dense(D, name="mix", param_dtype=F64)(jnp.tanh(emb.encode(ids))))

  x, y = _tied_batch(8)
  params = reference.init_params(Model(False), x)
  got, _, stats = reference.captured_update(Model(True), params, x, y, softmax_ce,
                                            TRANSFORMS["kfac"], captured=True)
  want, _, _ = reference.captured_update(Model(False), params, x, y, softmax_ce,
                                         TRANSFORMS["kfac"], captured=True)
  assert stats.unhandled == ()
  reference.assert_trees_close(got, want)


class NnxEmbedder(nnx.Module):
  """The NNX Gemma example's ``Embedder``: ``encode`` indexes the ``nnx.Param``, ``decode``
  multiplies by its value transposed."""

  def __init__(self, rngs):
    self.input_embedding = nnx.Param(jax.random.normal(rngs.params(), (V, D), F64))

  def encode(self, x):
    x = self.input_embedding[(x,)]
    x *= jnp.sqrt(x.shape[-1]).astype(x.dtype)
    return x

  def decode(self, x):
    return jnp.dot(x, self.input_embedding[...].T)


class NnxTiedNet(nnx.Module):

  def __init__(self, rngs, own=True):
    self.emb = NnxEmbedder(rngs) if own else nnx.Embed(V, D, param_dtype=F64, rngs=rngs)
    self.mix = nnx.Linear(D, D, param_dtype=F64, rngs=rngs)
    self.own = own

  def __call__(self, ids):
    h = self.emb.encode(ids) if self.own else self.emb(ids) * np.sqrt(D)
    h = self.mix(jnp.tanh(h))
    return self.emb.decode(h) if self.own else self.emb.attend(h)


def test_nnx_tied_table_of_its_own_equals_nnx_embed_attend():
  stats = _assert_nnx_equals_embed(NnxTiedNet, "input_embedding", *_tied_batch(4))
  assert stats.layers["emb"].attend_inputs is not None


class SoftCapped(GemmaEmbedder):

  def decode(self, x):  # Gemma 2's final logit soft cap inside decode
    return jnp.tanh(jnp.dot(x, self.table.T) / 30.0) * 30.0


class NormedDecode(GemmaEmbedder):

  def decode(self, x):  # h normalized inside decode: the recorded input is not the product's
    return jnp.dot(x / jnp.linalg.norm(x, axis=-1, keepdims=True), self.table.T)


class FirstRows(GemmaEmbedder):

  def decode(self, x):  # logits of the first K rows only
    return jnp.dot(x, self.table[:K].T)


NOT_A_TIED_OUTPUT = {SoftCapped: "it applies tanh to the product",
                     NormedDecode: "to the input",
                     FirstRows: "to the table"}


@pytest.mark.parametrize("cls", list(NOT_A_TIED_OUTPUT), ids=lambda c: c.__name__)
def test_a_method_that_is_more_than_the_tied_output_is_listed(cls):
  """The module is listed with the reason (its ``decode`` names the operation), and its
  gradient passes through unchanged."""

  class Model(nn.Module):
    @nn.compact
    def __call__(self, ids):
      emb = cls(name="emb")
      return emb.decode(nn.Dense(D, name="mix", param_dtype=F64)(jnp.tanh(emb.encode(ids))))

  x, y = _batch(5)
  params = reference.init_params(Model(), x)
  (_, grads), stats = reference.capture(Model(), softmax_ce)(params, x, y)
  assert set(stats.layers) == {"mix"}
  (reason,) = stats.unhandled
  assert reason.startswith("emb: ") and "decode" in reason, reason
  assert NOT_A_TIED_OUTPUT[cls] in reason, reason
  want = jax.grad(lambda p: softmax_ce(Model().apply({"params": p}, x), y))(params)
  reference.assert_trees_close(grads, want)


class BiasedDecode(GemmaEmbedder):
  """``decode`` with an optional bias array, and methods calling the table otherwise."""

  def decode(self, x, bias=None):
    out = jnp.dot(x, self.table.T)
    return out if bias is None else out + bias

  def head(self, h, bias):  # two arrays: no use of its own; decode runs inside it
    return self.decode(h) + bias

  def embed(self, x):  # a lookup on ids, the input itself on floats (reads no table)
    return self.table[x] if jnp.issubdtype(x.dtype, jnp.integer) else x * 1.0


class HiddenDecode(GemmaEmbedder):

  def decode(self, hidden):  # an input keyword the capture does not read as the input
    return jnp.dot(hidden, self.table.T)


class OtherCalls(nn.Module):
  """``decode(h)`` noted as the tied output, then the same method called in a way the capture
  does not take for a use: with a bias array, by a keyword it does not read as the input,
  inside a method on two arrays; or ``embed`` on floats, which reads no table."""

  case: str

  @nn.compact
  def __call__(self, ids):
    e = (HiddenDecode if self.case == "keyword" else BiasedDecode)(name="emb")
    if self.case == "reads_no_table":
      h = e.embed(nn.Dense(D, name="mix", param_dtype=F64)(jnp.tanh(e.embed(ids))))
      return e.decode(h)
    h = jnp.tanh(nn.Dense(D, name="mix", param_dtype=F64)(e.encode(ids)))
    bias = jnp.full((V,), 0.1, F64)
    second = {"bias_array": lambda: e.decode(jnp.tanh(h), bias),
              "keyword": lambda: e.decode(hidden=jnp.tanh(h)),
              "inside_head": lambda: e.head(jnp.tanh(h), bias)}[self.case]()
    return e.decode(h) + second


@pytest.mark.parametrize("case", ["bias_array", "keyword", "inside_head", "reads_no_table"])
def test_calls_of_a_use_method_that_are_no_use_keep_the_uses_in_order(case):
  """Every call of a use method is matched to the discovery pass's decision for it (before:
  counted as the next use by its name, an IndexError or a shape error). A call on two arrays
  or inside another method reads the table outside the noted uses: the module is listed, its
  gradient unchanged; a call that reads no table is no use: the module is captured as
  ``nn.Embed`` with its ``attend``."""
  x, y = _tied_batch(6)
  params = reference.init_params(OtherCalls(case), x)
  (_, grads), stats = reference.capture(OtherCalls(case), softmax_ce)(params, x, y)
  want_grads = jax.grad(lambda p: softmax_ce(OtherCalls(case).apply({"params": p}, x), y))(
      params)
  reference.assert_trees_close(grads, want_grads)
  if case != "reads_no_table":
    (reason,) = stats.unhandled
    assert reason.startswith("emb: ") and "outside the layer's own calls" in reason, reason
    return

  class Reference(nn.Module):
    @nn.compact
    def __call__(self, ids):
      emb = nn.Embed(V, D, name="emb", param_dtype=F64)
      return emb.attend(nn.Dense(D, name="mix", param_dtype=F64)(jnp.tanh(emb(ids))))

  assert stats.unhandled == ()
  got, _, _ = reference.captured_update(OtherCalls(case), params, x, y, softmax_ce,
                                        TRANSFORMS["kfac"], captured=True)
  want, _, _ = reference.captured_update(Reference(), _as_embed(params, "input_embedding"), x,
                                         y, softmax_ce, TRANSFORMS["kfac"])
  reference.assert_trees_close(_as_embed(got, "input_embedding"), want)


class NnxBiasedDecode(NnxEmbedder):

  def decode(self, x, bias=None):
    out = jnp.dot(x, self.input_embedding[...].T)
    return out if bias is None else out + bias


def test_nnx_call_of_a_use_method_that_is_no_use_is_listed():
  """NNX: ``decode(h)`` and ``decode(h2, bias_array)``: listed (before: an IndexError)."""

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.emb = NnxBiasedDecode(rngs)
      self.mix = nnx.Linear(D, D, param_dtype=F64, rngs=rngs)

    def __call__(self, ids):
      h = jnp.tanh(self.mix(self.emb.encode(ids)))
      return self.emb.decode(h) + self.emb.decode(jnp.tanh(h), jnp.full((V,), 0.1, F64))

  x, y = _tied_batch(7)
  model = Net(nnx.Rngs(0))
  (_, grads), stats = thor_optax.nnx.value_and_grad_with_stats(softmax_ce)(model, x, y)
  (reason,) = stats.unhandled
  assert reason.startswith("emb: ") and "outside the layer's own calls" in reason, reason
  want = nnx.grad(lambda m: softmax_ce(m(x), y))(model)
  reference.assert_trees_close(nnx.to_pure_dict(grads), nnx.to_pure_dict(want))
