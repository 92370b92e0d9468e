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


def test_nnx_table_of_its_own_equals_nnx_embed():
  x, y = _batch(1)
  model = NnxNet(nnx.Rngs(0))
  got, stats = _nnx_update(model, x, y)
  assert stats.unhandled == ()
  assert type(stats.layers["emb"]).__name__ == "LookupStats"
  own = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  reference_model = NnxNet(nnx.Rngs(1), own=False)
  nnx.update(reference_model, nnx.State(_as_embed(own, "tokens")))
  want, _ = _nnx_update(reference_model, x, y)
  reference.assert_trees_close(_as_embed(got, "tokens"), want)


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


class Tied(nn.Module):
  """MaxText's ``Embed`` with its ``attend``, used for the logits (a tied table)."""

  @nn.compact
  def __call__(self, ids):
    return self.variables["params"]["embedding"][ids] if self.has_variable(
        "params", "embedding") else self.param("embedding", nn.initializers.normal(1.0),
                                               (V, D), F64)[ids]

  def attend(self, query):
    return query @ self.variables["params"]["embedding"].T


class TiedNet(nn.Module):

  @nn.compact
  def __call__(self, ids):
    emb = Tied(name="emb")
    h = nn.Dense(D, name="mix", param_dtype=F64)(jnp.tanh(emb(ids)))
    return emb.attend(h)[..., :K]


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


def test_a_table_also_used_by_another_method_is_listed():
  """The table's ``attend`` (not intercepted) also reaches the outputs: weight sharing, listed
  (a plain step from its lookup rows alone would drop the logits' gradient)."""
  x, y = _batch(3)
  params = reference.init_params(TiedNet(), x)
  (_, grads), stats = reference.capture(TiedNet(), softmax_ce)(params, x, y)
  assert set(stats.layers) == {"mix"}
  (reason,) = stats.unhandled
  assert reason.startswith("emb: ") and "also" in reason, reason
  want = jax.grad(lambda p: softmax_ce(TiedNet().apply({"params": p}, x), y))(params)
  reference.assert_trees_close(grads, want)
