"""THOR's hardware-driven split: Kronecker factors as stacks of small uniform diagonal blocks.

Every factor (``A`` of dimension ``d_in (+1)`` and ``G`` of dimension ``d_out`` for each layer) is
approximated block-diagonally. A factor larger than ``block_size`` becomes ``ceil(d / b)`` blocks
of size ``b``, the last one identity-padded; a smaller factor is one block, padded to ``b`` when
the model's small factors are few next to its full blocks (at most a quarter as many: one
stack, one inversion in the compiled steps; :func:`_pads_small_factors`), else to the next power
of two so that few distinct sizes exist. Blocks of one size, from all layers, are stacked into
one ``(n_blocks, b, b)`` array (a *group*): one batched Cholesky per group inverts every block
of every layer, and the leading axis is what a device mesh can shard. A padded block's
covariance and products use its true ``d x d`` corner (the padding is identity).

The :class:`BlockLayout` is static: it follows from the parameter shapes alone, so ``init`` and
``update`` derive the same layout without storing it.

References:
  Chen et al., "THOR, Trace-Based Hardware-Driven Layer-Oriented Natural Gradient Descent
  Computation", AAAI 2021, section "Hardware-driven matrix splitting" (block size 128, identity
  padding; MindSpore ``thor.py`` ``_get_pad_dim``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from thor_optax._src import explicit
from thor_optax._src import linalg
from thor_optax._src import static_args
from thor_optax._src import stats as stats_lib


@dataclasses.dataclass(frozen=True)
class FactorSlot:
  """Where one Kronecker factor lives in its group's block stack.

  Attributes:
    dim: the factor's true dimension ``d``.
    block: block size ``b`` of its group (``b >= d`` if the factor is a single block).
    start: index of its first block in the group stack.
    num_blocks: number of blocks, ``copies * ceil(d / b)``.
    rank: ``m > 0`` if the factor's damped inverse is kept in low-rank (Woodbury) form with room
      for ``m`` rows (see :func:`build_layout`), 0 for dense ``b x b`` inverse blocks.
    copies: ``C``, the layers of a stack that each have this factor (a stack of ``C`` layers
      scanned by ``nn.scan``, parameters with ``C`` on a leading axis); their blocks follow
      one another, ``ceil(d / b)`` per layer, and their rows come as ``(C, R, d)``.
  """

  dim: int
  block: int
  start: int
  num_blocks: int
  rank: int = 0
  copies: int = 1

  @property
  def group(self) -> str:
    return group_key(self.block, self.rank)

  @property
  def blocks_per_copy(self) -> int:
    return self.num_blocks // self.copies

  @property
  def padded_dim(self) -> int:
    """The dimension of one copy's factor padded to whole blocks."""
    return self.block * self.blocks_per_copy

  @property
  def stop(self) -> int:
    return self.start + self.num_blocks

  def one_copy(self) -> "FactorSlot":
    """The slot of one layer of the stack (its blocks only; ``start`` is the first copy's)."""
    return dataclasses.replace(self, num_blocks=self.blocks_per_copy, copies=1)


@dataclasses.dataclass(frozen=True)
class BlockLayout:
  """Static description of all layers and factor blocks of a parameter tree.

  Attributes:
    layers: every layer a kind claimed (``layers.LayerSpec``), sorted by path.
    groups: ``{group_key: (block_size, n_blocks)}``.
    block_size: the split size the layout was built with (``None``: no split).
    ranks: ``{group_key: m}`` for the groups whose blocks are kept in low-rank form.
  """

  layers: tuple[Any, ...]
  groups: dict[str, tuple[int, int]]
  block_size: Optional[int]
  ranks: dict[str, int] = dataclasses.field(default_factory=dict)

  def real_dims(self, group: str) -> np.ndarray:
    """``(n_blocks, b)`` float array: 1 where a block row is a true dimension, 0 for padding."""
    b, n = self.groups[group]
    real = np.zeros((n, b), np.float32)
    for spec in self.layers:
      for slot in spec.slots:
        if slot.group != group:
          continue
        flat = np.zeros(slot.padded_dim, np.float32)
        flat[:slot.dim] = 1.0
        real[slot.start:slot.stop] = np.tile(flat.reshape(slot.blocks_per_copy, b),
                                             (slot.copies, 1))
    return real

  def layer(self, name: str) -> Any:
    for spec in self.layers:
      if spec.name == name:
        return spec
    raise KeyError(name)


def group_key(block: int, rank: int = 0) -> str:
  """Name of the group holding blocks of size ``block``: ``'b128'``, or ``'b785r128'`` for
  blocks kept in low-rank form with room for ``rank`` rows."""
  return f"b{block}r{rank}" if rank else f"b{block}"


def saves_memory(block: int, rows: int) -> bool:
  """Whether a ``b x b`` inverse block takes more memory than its low-rank (Woodbury) form,
  ``U (b, m)`` and the ``m x m`` core inverse: ``m (b + m) < b^2``, i.e. ``m < 0.618 b``."""
  return rows * (block + rows) < block * block


def _next_pow2(d: int) -> int:
  return 1 << max(0, (d - 1).bit_length())


def split_shape(dim: int, block_size: Optional[int]) -> tuple[int, int]:
  """``(block, num_blocks)`` for a factor of dimension ``dim``.

  ``block_size=None`` keeps the factor whole (one block of exactly ``dim``). Otherwise a factor
  larger than ``block_size`` is cut into ``ceil(dim / block_size)`` blocks, and a smaller one is a
  single block padded to the next power of two (capped at ``block_size``). :func:`build_layout`
  pads it to ``block_size`` instead when :func:`_pads_small_factors` says so.
  """
  if block_size is None:
    return dim, 1
  if dim > block_size:
    return block_size, math.ceil(dim / block_size)
  return min(_next_pow2(dim), block_size), 1


# Factors smaller than the block size are padded to it, into the one stack of full blocks,
# when that adds at most this share of its blocks; else each is padded to the next power of two.
_PAD_SMALL_SHARE = 0.25


def _pads_small_factors(factors: list[tuple[int, int]], block_size: Optional[int]) -> bool:
  """Whether the factors ``[(dimension, copies)]`` smaller than ``block_size`` are padded to
  it, so that every block is in one stack.

  Each distinct block size is a stack with its own inversion, loop and products in the
  compiled steps: on XLA:CPU, where compile time follows the number of kernels, the MNIST
  MLP's check step (one 10-dimensional factor beside 21 blocks of 128) had 278 kernels with
  two stacks and 228 with one; the CNN's (three stacks) 424 and 315. Padded, a small factor's
  block costs a full block's inversion and memory (its covariance, trace and products use its
  true corner), so it is done only when the small factors add at most ``_PAD_SMALL_SHARE`` of
  the full blocks there are (and never when there are none: a model of small layers keeps its
  small blocks).

  Args:
    factors: ``(d, C)`` of every factor: its dimension and its number of copies (layers of a
      stack, groups of a grouped convolution).
    block_size: the split size, or ``None`` (never padded).

  Returns:
    whether every factor smaller than ``block_size`` is one block of ``block_size``."""
  if block_size is None:
    return False
  full = sum(math.ceil(d / block_size) * c for d, c in factors if d >= block_size)
  small = sum(c for d, c in factors if d < block_size)
  return 0 < small <= _PAD_SMALL_SHARE * full


def module_leaves(tree: Any) -> dict[tuple[str, ...], dict[str, Any]]:
  """``{module path: {leaf name: leaf}}`` of a parameter (or gradient) tree, sorted by path."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  modules: dict[tuple[str, ...], dict[str, Any]] = {}
  for path, leaf in flat:
    keys = stats_lib.path_keys(path)
    modules.setdefault(keys[:-1], {})[keys[-1]] = leaf
  return dict(sorted(modules.items()))


def _check_block_size(block_size: Any) -> Optional[int]:
  if block_size is not None and (not isinstance(block_size, (int, np.integer))
                                 or isinstance(block_size, bool) or block_size < 1):
    raise ValueError(
        f"block_size must be a positive Python int or None, got {block_size!r}. It fixes array "
        "shapes, so it cannot be a traced value: " + static_args.hint())
  return None if block_size is None else int(block_size)


def build_layout(tree: Any, block_size: Optional[int],
                 rank_of: Callable[[int], int] = lambda block: 0,
                 captured: Optional[Mapping[str, tuple[str, tuple]]] = None) -> BlockLayout:
  """Builds the static layout of a parameter (or gradient) tree from the registered layer kinds.

  Args:
    tree: nested dict of arrays (or ``jax.ShapeDtypeStruct``), e.g. Flax ``params``.
    block_size: THOR split size ``b`` (positive int), or ``None`` for unsplit factors.
    rank_of: ``block -> m``, the rank of the low-rank form a group of blocks of that size is
      kept in (0: dense blocks); the inverse method's ``for_block(b).rank``.
    captured: ``{layer name: (kind name, hint)}`` of the layers a capture takes
      (``thor_optax.captured_layers``): only those layers are laid out, each claimed by its
      kind from the hint (``LayerKind.claim_captured``); ``None``: every module a registered
      kind claims from its parameter shapes alone. A layer claimed with ``groups=G`` (a
      grouped convolution) is laid out as a stack of ``G`` layers, each with its own factors.

  Returns:
    the :class:`BlockLayout`; layers appear in path order, ``A`` before ``G``.

  Raises:
    ValueError: if ``block_size`` is not a positive integer or ``None``.
  """
  from thor_optax._src import layers as layers_lib  # pylint: disable=import-outside-toplevel
  block_size = _check_block_size(block_size)
  claimed = []
  for path, leaves in module_leaves(tree).items():
    shapes = {name: tuple(int(s) for s in np.shape(leaf)) for name, leaf in leaves.items()}
    hint = (captured or {}).get(stats_lib.layer_name(path))
    found = None
    if captured is None or hint is not None:
      found = claim_stacked(path, shapes, hint)
    if found is not None:
      layers_lib.check_claim(found[0], path, shapes, found[1],
                             tuple(hint[1]) if hint is not None else ())
      claimed.append((path, shapes, hint, found))
  pad_small = _pads_small_factors(
      [(dim, math.prod(found[2]) * found[1].groups) for _, _, _, found in claimed
       for dim in (found[1].a_dim, found[1].g_dim) if dim is not None], block_size)
  counts: dict[tuple[int, int], int] = {}

  def slot(dim: Optional[int], copies: int) -> Optional[FactorSlot]:
    if dim is None:
      return None
    block, n = (block_size, 1) if pad_small and dim < block_size else split_shape(dim,
                                                                                  block_size)
    rank = rank_of(block)
    start = counts.get((block, rank), 0)
    counts[(block, rank)] = start + n * copies
    return FactorSlot(dim=dim, block=block, start=start, num_blocks=n * copies, rank=rank,
                      copies=copies)

  specs = []
  for path, shapes, hint, (kind, claim, stack) in claimed:
    per_layer = {name: shape[len(stack):] for name, shape in shapes.items()}
    if claim.groups > 1:  # a grouped layer: a stack of its groups, one group's shapes
      per_layer = group_shapes(kind, per_layer, claim.groups)
      stack = stack + (claim.groups,)
    copies = math.prod(stack)
    a = slot(claim.a_dim, copies)
    specs.append(layers_lib.LayerSpec(path, kind, tuple(sorted(per_layer.items())), a,
                                      slot(claim.g_dim, copies), stack, in_axes=claim.in_axes,
                                      groups=claim.groups,
                                      hint=() if hint is None else tuple(hint[1])))
    _check_dims(specs[-1], claim)
  groups = {group_key(b, r): (b, n) for (b, r), n in sorted(counts.items())}
  ranks = {group_key(b, r): r for (b, r) in sorted(counts) if r}
  return BlockLayout(tuple(specs), groups, block_size, ranks)


def _check_dims(spec: Any, claim: Any) -> None:
  """Raises ``ValueError`` naming the kind and the layer when a claim's factor dimensions do
  not fit its weight as the ``(d_in (+1 bias row), d_out)`` matrix the factors act on."""
  want_a = spec.d_in + int(spec.has_bias) if claim.a_dim is not None else None
  want_g = spec.d_out if claim.g_dim is not None else None
  if (claim.a_dim, claim.g_dim) != (want_a, want_g):
    raise ValueError(
        f"layer kind {spec.kind.name!r} claimed layer {spec.name!r} with a_dim={claim.a_dim}, "
        f"g_dim={claim.g_dim}, but its weight {spec.kind.weight!r} of shape "
        f"{spec.kernel_shape} is a ({spec.d_in}, {spec.d_out}) matrix"
        f"{' with a bias row' if spec.has_bias else ''}: its claim must give a_dim={want_a}, "
        f"g_dim={want_g} (or the kind must override kernel_matrix and matrix_dims).")


def group_shapes(kind: Any, shapes: Mapping[str, tuple[int, ...]],
                 groups: int) -> dict[str, tuple[int, ...]]:
  """One group's leaf shapes of a grouped layer, as the kind's ``split_groups`` splits it."""
  leaves = {name: jax.ShapeDtypeStruct(s, jnp.float32) for name, s in shapes.items()}
  split = jax.eval_shape(lambda t: kind.split_groups(t, groups, 0), leaves)
  return {name: tuple(int(d) for d in leaf.shape[1:]) for name, leaf in split.items()}


def claim_stacked(path: tuple[str, ...], shapes: dict[str, tuple[int, ...]],
                  captured: Optional[tuple[str, tuple]] = None) -> Optional[tuple]:
  """``(kind, claim, stack)`` of a module's leaves: claimed as they are (``stack = ()``), or,
  when no kind claims them, as a stack of layers: the fewest leading axes shared by every leaf
  (``nn.scan`` / ``nn.vmap`` with ``variable_axes={'params': 0}`` stack a layer's parameters on
  axis 0) whose removal leaves shapes a kind claims. ``captured``: ``(kind name, hint)`` from the
  capture, which fixes the kind (claiming with ``LayerKind.claim_captured``). ``None`` if
  neither.

  Raises:
    ValueError: if ``captured`` names a kind that is not registered, or one whose claim does not
      fit the parameter shapes.
  """
  from thor_optax._src import layers as layers_lib  # pylint: disable=import-outside-toplevel
  if captured is None:
    def claim(shapes, stacked=True):
      return layers_lib.claim(path, shapes, stacked)
  else:
    kind = layers_lib.kind_named(captured[0])

    def claim(shapes, stacked=True):
      del stacked
      found = kind.claim_captured(path, shapes, captured[1])
      return None if found is None else (kind, found)
  found = claim(shapes, stacked=False)
  if found is not None:
    return found + ((),)
  rank = min((len(s) for s in shapes.values()), default=0)
  for k in range(1, rank):
    stack = next(iter(shapes.values()))[:k]
    if any(s[:k] != stack for s in shapes.values()):
      break
    found = claim({name: s[k:] for name, s in shapes.items()})
    if found is not None:
      return found + (stack,)
  if captured is not None:
    raise ValueError(
        f"layers=captured_layers(stats): the capture took layer "
        f"{stats_lib.layer_name(path)!r} as a {captured[0]!r} layer {captured[1]}, which does "
        f"not fit its parameter shapes {shapes}; was the layout made from another model?")
  return None


# ------------------------------------------------------------------------------------------------
# Block arithmetic on a factor given as rows: F = scale * X^T X, X of shape (R, d), or, for a
# slot with C copies (a stack of layers), X of shape (C, R, d) and one scale per copy, (C,).


def blocked_rows(rows: jax.Array, slot: FactorSlot) -> jax.Array:
  """``(R, d)`` rows -> ``(R, num_blocks, b)``, zero-padding the columns to ``b * num_blocks``;
  ``(C, R, d)`` rows of ``C`` copies -> ``(R, C * blocks_per_copy, b)``, copy-major."""
  pad = slot.padded_dim - rows.shape[-1]
  if pad:
    rows = jnp.pad(rows, ((0, 0),) * (rows.ndim - 1) + ((0, pad),))
  if rows.ndim == 2:
    return rows.reshape(rows.shape[0], slot.num_blocks, slot.block)
  c, r, _ = rows.shape
  x = rows.reshape(c, r, slot.blocks_per_copy, slot.block)
  return jnp.moveaxis(x, 0, 1).reshape(r, slot.num_blocks, slot.block)


def block_scale(scale: jax.Array | float, slot: FactorSlot) -> jax.Array | float:
  """The scale of each block: a scalar as it is, or ``(C,)`` per-copy scales repeated over each
  copy's blocks, ``(num_blocks,)``."""
  if jnp.ndim(scale) == 0:
    return scale
  return jnp.repeat(scale, slot.blocks_per_copy)


def block_traces(rows: jax.Array, scale: jax.Array | float, slot: FactorSlot,
                 column_squares: Optional[jax.Array] = None) -> jax.Array:
  """Traces of the diagonal blocks of ``F = scale * rows^T rows`` without forming ``F``.

  Cost ``O(R d)``: ``tr(F_jj)`` is ``scale`` times the sum of squares of block ``j``'s columns;
  ``O(d)`` given those sums (``column_squares``), and ``rows`` is then not read.

  Args:
    rows: ``(R, d)``.
    scale: scalar.
    slot: the factor's slot (gives ``b`` and the number of blocks).
    column_squares: ``(d,)`` sums of squares of the columns of ``rows`` (``(C, d)`` for ``C``
      copies), or ``None``.

  Returns:
    ``(num_blocks,)`` traces.
  """
  if column_squares is not None:
    return block_scale(scale, slot) * jnp.sum(
        blocked_rows(column_squares[..., None, :], slot), axis=(0, 2))
  if _one_padded_block(slot):  # the padding's zeros cost as many reads as rows R times b
    return block_scale(scale, slot) * jnp.sum(jnp.square(rows), axis=(-2, -1)).reshape(
        slot.num_blocks)
  return block_scale(scale, slot) * jnp.sum(jnp.square(blocked_rows(rows, slot)), axis=(0, 2))


def _one_padded_block(slot: FactorSlot) -> bool:
  """Whether each copy of the factor is one block with padding (``d < b``)."""
  return slot.blocks_per_copy == 1 and slot.dim < slot.block


def block_covariances(rows: jax.Array, scale: jax.Array | float, slot: FactorSlot,
                      idx: jax.Array) -> jax.Array:
  """The selected diagonal blocks of ``F = scale * rows^T rows``.

  Args:
    rows: ``(R, d)``.
    scale: scalar.
    slot: the factor's slot.
    idx: ``(K,)`` int block indices within the factor.

  Returns:
    ``(K, b, b)``; padded rows/columns are zero.
  """
  scale = block_scale(scale, slot)
  scale = scale if jnp.ndim(scale) == 0 else jnp.take(scale, idx)[:, None, None]
  if _one_padded_block(slot):  # the d x d product, padded: not R b^2 FLOPs on zeros
    x = rows if rows.ndim == 3 else rows[None]
    x = jnp.take(x, idx, axis=0)
    pad = slot.block - slot.dim
    cov = jnp.einsum("krb,krc->kbc", x, x, out_sharding=explicit.contraction_sharding(x))
    return scale * jnp.pad(cov, ((0, 0), (0, pad), (0, pad)))
  x = jnp.take(blocked_rows(rows, slot), idx, axis=1)
  # Under an explicit-sharding mesh the examples axis ``R`` may be sharded: the contraction
  # over it gives replicated blocks (the compiler's all-reduce).
  return scale * jnp.einsum("rkb,rkc->kbc", x, x,
                            out_sharding=explicit.contraction_sharding(x))


def left_multiply(blocks: jax.Array, x: jax.Array) -> jax.Array:
  """``blockdiag(blocks) @ x`` for ``blocks (n, b, b)`` and ``x (d, m)`` with ``d <= n b``."""
  n, b, _ = blocks.shape
  d = x.shape[0]
  if n == 1 and d < b:  # one padded block: its true corner (identity on the padding)
    return blocks[0, :d, :d] @ x
  xp = jnp.pad(x, ((0, n * b - d), (0, 0))) if n * b != d else x
  y = jnp.einsum("kij,kjm->kim", blocks, xp.reshape(n, b, -1))
  return y.reshape(n * b, -1)[:d]


def right_multiply(x: jax.Array, blocks: jax.Array) -> jax.Array:
  """``x @ blockdiag(blocks)`` for ``x (m, d)`` and ``blocks (n, b, b)`` with ``d <= n b``."""
  n, b, _ = blocks.shape
  d = x.shape[1]
  if n == 1 and d < b:  # one padded block: its true corner (identity on the padding)
    return x @ blocks[0, :d, :d]
  xp = jnp.pad(x, ((0, 0), (0, n * b - d))) if n * b != d else x
  y = jnp.einsum("mki,kij->mkj", xp.reshape(x.shape[0], n, b), blocks)
  return y.reshape(x.shape[0], n * b)[:, :d]


def _low_rank_apply(u: jax.Array, core: jax.Array, damping: jax.Array,
                    x: jax.Array) -> jax.Array:
  """``F_k^-1 x_k = (x_k - U_k C_k U_k^T x_k) / d_k`` per block, ``x (n, b, cols)``."""
  ux = jnp.einsum("kbm,kbc->kmc", u, x)
  y = x - jnp.einsum("kbm,kmj,kjc->kbc", u, core, ux)
  return y / damping[:, None, None]


def left_multiply_low_rank(u: jax.Array, core: jax.Array, damping: jax.Array,
                           x: jax.Array) -> jax.Array:
  """``blockdiag(F_k^-1) @ x`` with ``F_k^-1 = (I - U_k C_k U_k^T) / d_k`` (Woodbury form).

  Costs ``O(b m cols)`` per block instead of ``O(b^2 cols)`` for a dense inverse block.

  Args:
    u: ``(n, b, m)`` the factor blocks' scaled rows (``F_k = U_k U_k^T`` on true dimensions).
    core: ``(n, m, m)`` the core inverses ``C_k = (U_k^T U_k + d_k I)^-1``.
    damping: ``(n,)`` the damping ``d_k`` of each block.
    x: ``(d, cols)`` with ``d <= n b``.

  Returns:
    ``(d, cols)``.
  """
  n, b, _ = u.shape
  d = x.shape[0]
  xp = jnp.pad(x, ((0, n * b - d), (0, 0))) if n * b != d else x
  y = _low_rank_apply(u, core, damping, xp.reshape(n, b, -1))
  return y.reshape(n * b, -1)[:d]


def right_multiply_low_rank(x: jax.Array, u: jax.Array, core: jax.Array,
                            damping: jax.Array) -> jax.Array:
  """``x @ blockdiag(F_k^-1)`` for ``x (rows, d)``; see :func:`left_multiply_low_rank`."""
  return left_multiply_low_rank(u, core, damping, x.T).T


# ------------------------------------------------------------------------------------------------
# Masked refresh with a static budget.


def refresh_budgets(n: int, num_buckets: int) -> tuple[int, ...]:
  """Static block budgets ``0 < ... <= n`` among which a masked refresh picks the smallest fit."""
  return tuple(sorted({0} | {math.ceil(n * (i + 1) / num_buckets) for i in range(num_buckets)}))


def masked_block_update(
    mask: jax.Array,
    old: Any,
    fn: Callable[[jax.Array], tuple[Any, jax.Array]],
    num_buckets: int = 4,
    batched: bool = False,
) -> tuple[Any, jax.Array]:
  """Recomputes only the blocks selected by ``mask``, with real savings under ``jit``.

  ``jnp.where`` would compute every block and discard most. Instead only the selected blocks
  are computed, in one of two forms, chosen per platform when the step is lowered
  (``linalg.platform_dependent``, like ``linalg.lapack_safe``):

  * on CPU, one block at a time in a loop that runs as many times as blocks are selected
    (:func:`sequential_block_update`): the CPU factorizes one block at a time anyway
    (``linalg.lapack_safe``), so the loop costs what the blocks cost, and the step holds one
    copy of ``fn``, which keeps its compilation short;
  * elsewhere (and with ``batched``), batched: the selected blocks are gathered into a buffer
    whose size is the smallest static budget (:func:`refresh_budgets`) that holds them, and
    ``lax.switch`` runs only that budget's branch (:func:`budgeted_block_update`): refreshing
    1 block of 32 costs about a quarter of refreshing all of them with 4 buckets, and nothing
    when none is due.

  Args:
    mask: ``(n,)`` bool, blocks to refresh.
    old: pytree of arrays with leading axis ``n`` (current values, kept where not refreshed).
    fn: ``fn(idx) -> (new, accept)``; ``idx`` is ``(K,)`` int32 block indices, ``new`` a pytree
      like ``old`` with leading axis ``K``, ``accept`` ``(K,)`` bool (e.g. "result is finite").
      ``idx`` may contain blocks outside the mask when the budget exceeds the count; their
      results are discarded.
    num_buckets: number of non-zero budgets of the batched form.
    batched: the batched form on every platform: for an ``fn`` that gains from seeing all
      its blocks at once (GEMMs over the blocks' rows, whose layout XLA fuses into them; or
      blocks spread over devices by ``block_sharding``, all but one idle one at a time).

  Returns:
    ``(updated, refreshed)``: ``old`` with accepted selected blocks replaced, and the ``(n,)``
    bool mask of blocks actually replaced.
  """
  def budgeted(m, o):
    return budgeted_block_update(m, o, fn, num_buckets)

  if batched:
    return budgeted(mask, old)
  return linalg.platform_dependent(
      mask, old, cpu=lambda m, o: sequential_block_update(m, o, fn), default=budgeted)


def _selected_first(mask: jax.Array) -> jax.Array:
  """``(n,)`` int32 block indices, the selected ones first (in block order)."""
  return jnp.argsort(jnp.logical_not(mask), stable=True).astype(jnp.int32)


def budgeted_block_update(mask: jax.Array, old: Any,
                          fn: Callable[[jax.Array], tuple[Any, jax.Array]],
                          num_buckets: int) -> tuple[Any, jax.Array]:
  """:func:`masked_block_update`'s batched form: ``fn`` once on the smallest static budget of
  blocks that holds the selected ones (one ``lax.switch`` branch per budget)."""
  n = mask.shape[0]
  budgets = refresh_budgets(n, num_buckets)
  order = _selected_first(mask)
  none = jnp.zeros((n,), bool)

  def branch(k: int):
    def run(_):
      if k == 0:
        return old, none
      if k == n:  # every block, in block order: no gather or scatter of the blocks
        new, accept = fn(jnp.arange(n, dtype=jnp.int32))
        take = jnp.logical_and(mask, accept)
        return jax.tree_util.tree_map(
            lambda o, nw: jnp.where(take.reshape((n,) + (1,) * (o.ndim - 1)),
                                    nw.astype(o.dtype), o), old, new), take
      idx = order[:k]
      new, accept = fn(idx)
      take = jnp.logical_and(mask[idx], accept)

      def put(o, nw):
        sel = take.reshape((k,) + (1,) * (o.ndim - 1))
        return o.at[idx].set(jnp.where(sel, nw.astype(o.dtype), o[idx]))

      return jax.tree_util.tree_map(put, old, new), none.at[idx].set(take)

    return run

  # The smallest budget >= the count: the number of budgets below it (a sum, not a search).
  which = jnp.sum(jnp.asarray(budgets) < jnp.sum(mask), dtype=jnp.int32)
  return jax.lax.switch(which, [branch(k) for k in budgets], None)


def sequential_block_update(mask: jax.Array, old: Any,
                            fn: Callable[[jax.Array], tuple[Any, jax.Array]]
                            ) -> tuple[Any, jax.Array]:
  """:func:`masked_block_update`'s sequential form: ``fn`` on one selected block at a time
  (``idx`` of shape ``(1,)``), in a loop of as many iterations as blocks are selected.

  The loop sits in a ``lax.cond`` that skips it when no block is selected: on CPU, with no
  block due, the MNIST CNN's check update took 35 ms instead of 22 while the loop of zero
  iterations was in the step (22 with XLA's while-loop invariant code motion disabled)."""
  n = mask.shape[0]
  order = _selected_first(mask)

  def body(i, carry):
    out, done = carry
    idx = jax.lax.dynamic_slice_in_dim(order, i, 1)
    new, accept = fn(idx)

    def put(o, nw):
      kept = jax.lax.dynamic_slice_in_dim(o, idx[0], 1)
      sel = accept.reshape((1,) + (1,) * (o.ndim - 1))
      return jax.lax.dynamic_update_slice_in_dim(o, jnp.where(sel, nw.astype(o.dtype), kept),
                                                 idx[0], 0)

    return jax.tree_util.tree_map(put, out, new), done.at[idx].set(accept)

  count = jnp.sum(mask, dtype=jnp.int32)
  none = (old, jnp.zeros((n,), bool))
  return jax.lax.cond(count > 0, lambda: jax.lax.fori_loop(0, count, body, none), lambda: none)
