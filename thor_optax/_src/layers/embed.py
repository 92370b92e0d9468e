"""Embeddings ``y = embedding[ids]``: Flax ``nn.Embed`` and ``nnx.Embed``.

The input of an embedding is the one-hot vector of its id, so its input factor is diagonal:
``A = (1/N) sum_{n,t} e_id e_id^T``, ``A_vv`` = occurrences of token ``v`` per example (THOR:
the embedding's ``A`` is the token-frequency vector). ``A`` is kept as side curvature, a
``(vocab,)`` vector refreshed at every check step (:class:`DiagonalState`); only ``G`` lives in
the block stacks. The weight ``(vocab, features)`` is already the ``(d_A, d_G)`` matrix.

A module whose ``attend`` runs (tied input/output embeddings) is a shared layer and is listed
as unhandled.

References:
  Chen et al., "THOR", AAAI 2021 (diagonal ``A`` of embeddings).
"""

from __future__ import annotations

import dataclasses
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
  """

  inputs: jax.Array
  cotangents: jax.Array


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
  return counts / stats.inputs.shape[0]


class Embed(base.LayerKind):
  """``nn.Embed`` / ``nnx.Embed``: a rank-2 ``embedding`` ``(vocab, features)``."""

  name = "embed"
  stats_type = EmbedStats
  example_axes = {"inputs": 0, "cotangents": 1}
  linen_modules = (nn.Embed,)
  nnx_modules = (nnx.Embed,)
  methods = ("__call__", "attend")
  weight = "embedding"

  def per_loss_term(self, stats, num_terms):
    ids, cotangents = base.regroup_examples(stats.inputs, stats.cotangents, num_terms, 0)
    return EmbedStats(inputs=ids, cotangents=cotangents)

  def plan(self, module, methods, input_shape) -> base.Plan:
    del module
    if "attend" in methods:
      return base.Plan(None, "attend() used in the forward pass (tied embedding: shared layer)")
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
