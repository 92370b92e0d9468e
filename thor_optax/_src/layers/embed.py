"""Embeddings ``y = embedding[ids]``: Flax ``nn.Embed`` and ``nnx.Embed``.

The input of an embedding is the one-hot vector of its id, so its input factor is diagonal:
``A = (1/M) sum_{n,t} e_id e_id^T`` for ``M`` loss terms, ``A_vv`` = occurrences of token ``v``
per loss term (per example for a loss per example; THOR:
the embedding's ``A`` is the token-frequency vector). ``A`` is kept as side curvature, a
``(vocab,)`` vector refreshed at every check step (:class:`DiagonalState`); only ``G`` lives in
the block stacks. The weight ``(vocab, features)`` is already the ``(d_A, d_G)`` matrix.

Tied input and output embeddings (``attend``, ``logits = h @ embedding^T``) share the weight
(Eschenhagen et al. 2023, K-FAC-expand over the uses): seen from the ``(vocab, features)``
weight, an ``attend`` use has the logit cotangents ``g_l`` on the vocabulary side and its input
``h`` on the feature side, so its rows join the lookup's: ``A = (1/M) (sum e_id e_id^T +
sum_s g_l g_l^T)``, kept diagonal (its ``(vocab,)`` diagonal: token counts plus squared logit
cotangents), and ``G = (1/(N P)) (sum_s g g^T + sum h h^T)`` over the ``P`` positions of all
uses.

References:
  Chen et al., "THOR", AAAI 2021 (diagonal ``A`` of embeddings).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, NamedTuple, Optional

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp

from thor_optax._src import explicit
from thor_optax._src.layers import base
from thor_optax._src.layers import dense


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EmbedStats:
  """Statistics of one embedding lookup ``y = embedding[ids]`` (Flax ``nn.Embed``).

  Attributes:
    inputs: integer token ids, shape ``(N, ...)``; axis 0 indexes examples, further axes are
      positions.
    cotangents: per-example output cotangents, shape ``(S, N, ..., features)``.
    attend_inputs: for a tied embedding, the inputs ``h`` of its ``attend`` uses,
      ``(N, P, features)``; ``None`` otherwise.
    attend_cotangents: the logit cotangents of those uses, ``(S, N, P, vocab)``, or ``None``.
    num_terms: the ``M`` loss terms ``A`` divides by when the leading axis is not them (static):
      rows that do not regroup to ``M`` (a graph network's nodes under a per-graph loss, a
      language model whose loss drops the last position, an ensemble member's share of the
      terms); ``None`` (default): the leading axis.

  Source: Chen et al., THOR, AAAI 2021 (an embedding's diagonal ``A`` from its token counts);
  Eschenhagen et al., NeurIPS 2023 (a tied embedding's uses as positions sharing the weight).
  """

  inputs: jax.Array
  cotangents: jax.Array
  attend_inputs: Optional[jax.Array] = None
  attend_cotangents: Optional[jax.Array] = None
  num_terms: Optional[int] = dataclasses.field(default=None, metadata=dict(static=True))


class DiagonalState(NamedTuple):
  """An embedding's diagonal ``A`` in the optimizer state.

  Attributes:
    a_diagonal: ``(vocab,)`` the inverse method's form of ``A``: the damped inverse
      ``1 / (A_vv + d_A)`` (ones before the first check), or ``A``'s values themselves for a
      method that damps ``A (x) G`` exactly (eigh; zeros before the first check).
  """

  a_diagonal: jax.Array


class StoredDiagonalState(NamedTuple):
  """:class:`DiagonalState` plus the stored (running-average) ``A`` of the accumulator.

  Attributes:
    a_diagonal: as :class:`DiagonalState`.
    a_factor: ``(vocab,)`` the stored ``A`` (zeros before the first check).
  """

  a_diagonal: jax.Array
  a_factor: jax.Array


def embedding_frequencies(spec: base.LayerSpec, stats: EmbedStats,
                          dtype: jnp.dtype) -> jax.Array:
  """``(vocab,)`` diagonal of ``A``: token counts per example (ids outside ``[0, vocab)`` are
  not counted); it sums to ``T``, the positions per example. Ids sharded with an explicit
  sharding are gathered first (a scatter with sharded indices is rejected)."""
  ids = explicit.replicate(stats.inputs).reshape(-1)
  counts = jnp.zeros((spec.kernel_shape[0],), dtype).at[ids].add(1.0, mode="drop")
  diagonal = counts / base.a_divisor(stats, stats.inputs.shape[0])
  if stats.attend_cotangents is not None:  # a tied embedding's logit cotangents
    g = stats.attend_cotangents.astype(dtype)
    diagonal = diagonal + jnp.sum(g * g, axis=tuple(range(g.ndim - 1))) / base.a_divisor(
        stats, g.shape[1])
  return diagonal


class Embed(base.LayerKind):
  """The ``'embed'`` kind: ``nn.Embed`` / ``nnx.Embed`` (and their subclasses), a rank-2
  ``embedding`` ``(vocab, features)``, no bias; both ``__call__`` and ``attend`` are
  intercepted.

  The embedding is already the ``(d_A, d_G) = (vocab, features)`` matrix. ``A`` is diagonal,
  the ``(vocab,)`` token counts per loss term (plus a tied embedding's squared logit
  cotangents), kept as side curvature outside the block stacks; ``G`` (``features``) is built
  from the lookups' cotangents and the ``attend`` uses' inputs (module docstring). Statistics:
  :class:`EmbedStats`. From parameter shapes it claims any rank-2 ``embedding``.

  Listed in ``CurvatureStats.unhandled`` instead of captured: a lookup of a scalar id (no batch
  axis), several uses (lookups, ``attend``) of which one runs inside a lifted transform or
  that see different numbers of examples, a layer inside a loop over its weights, and a
  subclass overriding ``__call__``, ``attend`` or ``param``.

  Raises:
    ValueError: at a check step, naming the layer, for statistics that are not
      :class:`EmbedStats`, ids that are not integers, cotangents that are not floating point
      ``(S, *ids.shape, features)``, or ``attend_inputs`` / ``attend_cotangents`` not both
      given or not ``(N, ..., features)`` / ``(S, N, ..., vocab)`` over the same positions.

  Source: Chen et al., THOR, AAAI 2021 (diagonal ``A`` of embeddings); Martens & Grosse,
  K-FAC, ICML 2015 (``G``); Eschenhagen et al., NeurIPS 2023 (tied uses).
  """

  name = "embed"
  stats_type = EmbedStats
  example_axes = {"inputs": 0, "cotangents": 1, "attend_inputs": 0, "attend_cotangents": 1}
  linen_modules = (nn.Embed,)
  nnx_modules = (nnx.Embed,)
  methods = ("__call__", "attend")
  weight = "embedding"
  integer_inputs = True
  shares_weights = True

  def make_shared_stats(self, methods, inputs, cotangents, **meta) -> EmbedStats:
    """Lookups' ids and cotangents side by side, ``attend`` uses' ``h`` and logit cotangents
    side by side (``(N, 0)`` ids when the embedding is only attended)."""
    del meta
    calls = [(x, g) for m, x, g in zip(methods, inputs, cotangents) if m == "__call__"]
    attends = [(x, g) for m, x, g in zip(methods, inputs, cotangents) if m == "attend"]
    h = dense.join_positions([x for x, _ in attends], 0) if attends else None
    g_l = dense.join_positions([g for _, g in attends], 1) if attends else None
    if calls:
      ids = jnp.concatenate([x.reshape(x.shape[0], -1) for x, _ in calls], axis=1)
      g = dense.join_positions([g for _, g in calls], 1)
    else:
      ids = jnp.zeros((h.shape[0], 0), jnp.int32)
      g = jnp.zeros(g_l.shape[:2] + (0, h.shape[-1]), h.dtype)
    return EmbedStats(ids, g, h, g_l)

  def transposed_use(self, leaf, shape):
    """The tied output ``h @ embedding.T`` of a ``Dense`` given the table transposed: an
    ``attend`` use."""
    return ("attend", None) if leaf == self.weight and len(shape) == 2 else None

  def per_loss_term(self, stats, num_terms, weight_sharing):
    """Expand always (a reduced one-hot input is not one token: ``A`` would not be
    diagonal)."""
    del weight_sharing
    ids, cotangents = base.regroup_examples(stats.inputs, stats.cotangents, num_terms, 0)
    h, g_l = stats.attend_inputs, stats.attend_cotangents
    if h is not None:
      h, g_l = base.regroup_examples(h, g_l, num_terms, 1)
    return EmbedStats(ids, cotangents, h, g_l, base.terms_divisor(ids.shape[0], num_terms))

  def plan(self, module, methods, input_shape) -> base.Plan:
    del module, methods
    if not input_shape:
      return base.Plan(None, "embedding of a scalar id (no batch axis)")
    return base.Plan({})

  def claim(self, path: tuple[str, ...],
            shapes: Mapping[str, tuple[int, ...]]) -> Optional[base.Claim]:
    del path
    table = shapes.get("embedding")
    if table is None or len(table) != 2:
      return None
    return base.Claim(a_dim=None, g_dim=table[1])

  def check_stats(self, spec, stats) -> None:
    super().check_stats(spec, stats)
    dense.check_cotangents(spec, stats)
    a, g = stats.inputs, stats.cotangents
    if not jnp.issubdtype(a.dtype, jnp.integer):
      raise ValueError(f"{dense.where(spec)}: inputs must be integer token ids, got dtype "
                       f"{a.dtype}.")
    if tuple(g.shape[1:-1]) != tuple(a.shape):
      raise ValueError(
          f"{dense.where(spec)}: cotangents must have shape (S, *ids.shape, {spec.d_out}) = "
          f"(S, {', '.join(map(str, a.shape))}, {spec.d_out}), got {g.shape}.")
    h, g_l = stats.attend_inputs, stats.attend_cotangents
    if (h is None) != (g_l is None):
      raise ValueError(f"{dense.where(spec)}: attend_inputs and attend_cotangents must both be "
                       "given (a tied embedding) or both be None.")
    if h is not None and (h.shape[-1] != spec.d_out or g_l.shape[-1] != spec.kernel_shape[0]
                          or tuple(g_l.shape[1:-1]) != tuple(h.shape[:-1])):
      raise ValueError(
          f"{dense.where(spec)}: attend_inputs must be (N, ..., {spec.d_out}) and "
          f"attend_cotangents (S, N, ..., {spec.kernel_shape[0]}) over the same positions, got "
          f"{h.shape} and {g_l.shape}.")

  def cotangent_rows(self, spec, stats, dtype, *, sampling=None, key=None) -> base.FactorRows:
    """``G``'s rows: the lookups' cotangents, then a tied embedding's ``attend`` inputs, with
    scale ``1 / (N P)`` over the positions of all uses."""
    del sampling, key
    rows = explicit.flatten_rows(stats.cotangents).astype(dtype)
    positions = math.prod(stats.cotangents.shape[1:-1])
    if stats.attend_inputs is not None:
      h = stats.attend_inputs
      rows = jnp.concatenate([rows, h.reshape(-1, h.shape[-1]).astype(dtype)], axis=0)
      positions += math.prod(h.shape[:-1])
    return base.FactorRows(rows, jnp.asarray(1.0 / positions, dtype))

  def input_rows(self, spec, stats, dtype, *, sampling=None, key=None) -> jax.Array:
    """The diagonal ``A``, ``(vocab,)`` (see :func:`embedding_frequencies`)."""
    del sampling, key
    return embedding_frequencies(spec, stats, dtype)

  def side_init(self, spec, dtype, method, accumulator):
    vocab = spec.kernel_shape[0]
    diagonal = method.diagonal_init(vocab, dtype)
    if accumulator.stores_factors:
      return StoredDiagonalState(diagonal, jnp.zeros((vocab,), dtype))
    return DiagonalState(diagonal)

  def side_refresh(self, spec, stats, state, factors, damping, method, accumulator):
    """Refreshes ``A`` at every check step (running average if the accumulator stores it)."""
    del spec, stats, damping
    freq = factors.a
    if accumulator.stores_factors:
      freq = accumulator.blend(state.a_factor, freq, jnp.all(state.a_factor == 0))
    new = method.diagonal(freq, factors.d_a)
    ok = jnp.all(jnp.isfinite(new))
    diagonal = jnp.where(ok, new, state.a_diagonal)
    if accumulator.stores_factors:
      return StoredDiagonalState(diagonal, jnp.where(ok, freq, state.a_factor))
    return DiagonalState(diagonal)

  def a_operator(self, spec, state, method):
    return method.diagonal_operator(state.a_diagonal)
