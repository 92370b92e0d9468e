"""Raw per-layer curvature statistics, as handed from capture to the transforms.

The capture side (``thor_optax.flax``) knows the model; the transforms know the maths. What
passes between them is defined here: for every preconditioned layer, the statistics container of
its layer kind (``layers/*.py``: the layer input ``a`` and the per-example output cotangents
``g``, plus the static metadata the kind needs to form its Kronecker factors). All classes are
pytrees whose arrays are leaves and whose metadata is static, so statistics go through
``jax.jit`` as ordinary arguments and results.

References:
  Martens & Grosse, "Optimizing Neural Networks with Kronecker-factored Approximate Curvature",
  ICML 2015, section 3 (dense ``a``, ``g``).
  Grosse & Martens, "A Kronecker-factored approximate Fisher matrix for convolution layers",
  ICML 2016, section 3 (conv patches).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping
import weakref

import jax

from thor_optax._src import layers as layers_lib
from thor_optax._src.layers import channel_affine
from thor_optax._src.layers import conv
from thor_optax._src.layers import dense
from thor_optax._src.layers import dense_general
from thor_optax._src.layers import einsum
from thor_optax._src.layers import embed
from thor_optax._src.layers import lookup
from thor_optax._src.layers import matmul
from thor_optax._src.layers import norm


DenseStats = dense.DenseStats
DenseGeneralStats = dense_general.DenseGeneralStats
EinsumStats = einsum.EinsumStats
ConvStats = conv.ConvStats
EmbedStats = embed.EmbedStats
NormStats = norm.NormStats
MatmulStats = matmul.MatmulStats
ChannelAffineStats = channel_affine.ChannelAffineStats
LookupStats = lookup.LookupStats
LayerStats = Any  # an instance of a registered layer kind's ``stats_type``


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CurvatureStats:
  """All statistics of one forward/backward pass.

  Attributes:
    layers: nested dict mirroring the parameter tree; at every preconditioned layer's module
      path it holds the statistics of its layer kind (:class:`DenseStats`, :class:`ConvStats`,
      :class:`EmbedStats`, :class:`NormStats`, or a registered kind's) (for example
      ``layers['Block_0']['Dense_1']`` for ``params['Block_0']['Dense_1']``).
    unhandled: static tuple of ``"path: reason"`` strings naming modules with parameters that
      were not captured; their gradients pass through the transforms unchanged.
    exact_rows: static sorted tuple of layer names (``'Block_0/Dense_1'``) whose statistics are
      the rows behind the layer's gradient: its gradient matrix is ``a^T g / num_loss_terms``
      with ``a (R, d_A)`` and ``g (R, d_G)`` the kind's input and cotangent rows
      (``LayerKind.input_rows`` / ``cotangent_rows``), row for row. True for an empirical
      Fisher (one cotangent sample, the training loss's own) of a kind with
      ``gradient_from_rows`` when the layer's positions were not reduced (``weight_sharing``)
      and its weights are not shared over a loop's iterations. A plain step given these
      statistics as ``gradient_stats=`` preconditions such layers in sample space
      (``sample_space.py``).
    num_loss_terms: static int, the number of terms ``M`` the loss averages (1 for a summed
      loss); cotangents are ``M`` times the loss's.
    stacked: static sorted tuple of ``(layer name, k)`` for the layers of a stack
      (``nn.scan`` / ``nn.vmap`` over layers): every array of their statistics has ``k``
      leading stack axes before the kind's own (``concatenate_stats`` joins after them).

  Source: this project (the boundary between capture and transforms); the per-layer ``a`` and
  ``g`` are K-FAC's (Martens & Grosse, ICML 2015), a convolution's KFC's (Grosse & Martens,
  ICML 2016).
  """

  layers: Mapping[str, Any]
  unhandled: tuple[str, ...] = dataclasses.field(
      default=(), metadata=dict(static=True))
  exact_rows: tuple[str, ...] = dataclasses.field(
      default=(), metadata=dict(static=True))
  num_loss_terms: int = dataclasses.field(default=1, metadata=dict(static=True))
  stacked: tuple[tuple[str, int], ...] = dataclasses.field(
      default=(), metadata=dict(static=True))


is_layer_stats = layers_lib.is_layer_stats


class _Marks:
  """Live arrays or tracers by identity, each with the objects it was recorded with (weak
  references: an entry goes with its object, so an ``id`` is never matched to a later one)."""

  def __init__(self):
    self._refs: dict[int, tuple[weakref.ref, tuple[weakref.ref, ...]]] = {}

  def add(self, leaf: Any, partners: tuple[Any, ...] = ()) -> None:
    key = id(leaf)

    def forget(ref, key=key):
      if self._refs.get(key, (None,))[0] is ref:
        del self._refs[key]

    try:
      self._refs[key] = (weakref.ref(leaf, forget), tuple(weakref.ref(p) for p in partners))
    except TypeError:  # not weakly referenceable (a Python number): never matched
      pass

  def holds(self, leaf: Any, partners: tuple[Any, ...] = ()) -> bool:
    """Whether ``leaf`` was recorded, with exactly these partners (by identity)."""
    ref, refs = self._refs.get(id(leaf), (None, ()))
    return (ref is not None and ref() is leaf and len(refs) == len(partners)
            and all(r() is p for r, p in zip(refs, partners)))


# The gradient leaves the captures returned, each with its layer's statistics arrays.
_CAPTURED_GRADIENTS = _Marks()


def mark_captured_gradients(grads: Any, stats: CurvatureStats) -> None:
  """Records the gradient leaves of each layer a capture returns with that layer's statistics,
  so that a plain step from the rows (``gradient_stats=``) can tell the gradient those rows give
  from any other array.

  The rows form rebuilds a layer's preconditioned gradient from the rows, ``(a A^-1)^T (g G^-1)
  / M``, without reading the gradient leaf: it is right only for the very gradient the rows
  give. A transform before the preconditioner (``optax.clip_by_global_norm``, a scale, weight
  decay, an accumulation) makes new arrays, and statistics of another batch are other arrays,
  which :func:`is_captured_gradient` does not pair; such a layer is then preconditioned from
  its gradient leaf. Identity is Python's, at trace time: it costs nothing in the compiled step,
  and holds for arrays passed along unchanged (``optax.chain``, ``optax.masked``,
  ``nnx.Optimizer``) within one trace (capture and update in one ``jax.jit``).
  """
  by_layer: dict[str, list] = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(grads)[0]:
    by_layer.setdefault(layer_name(path_keys(path)[:-1]), []).append(leaf)
  for name, layer in flatten_layer_stats(stats).items():
    partners = tuple(jax.tree_util.tree_leaves(layer))
    for leaf in by_layer.get(name, ()):
      _CAPTURED_GRADIENTS.add(leaf, partners)


def is_captured_gradient(leaf: Any, layer_stats: Any) -> bool:
  """Whether ``leaf`` is (the same object as) a live gradient leaf a capture returned together
  with these statistics of its layer (:func:`mark_captured_gradients`)."""
  return _CAPTURED_GRADIENTS.holds(leaf, tuple(jax.tree_util.tree_leaves(layer_stats)))


def flatten_layer_stats(stats: CurvatureStats | Mapping[str, Any]) -> dict[str, LayerStats]:
  """Flattens statistics to ``{"Block_0/Dense_1": DenseStats, ...}`` keyed by module path.

  Args:
    stats: a :class:`CurvatureStats` or its ``layers`` dict.

  Returns:
    dict from ``/``-joined module path to that layer's statistics.

  Raises:
    TypeError: if a leaf of the tree is not a layer's statistics.
  """
  layers = stats.layers if isinstance(stats, CurvatureStats) else stats
  flat, _ = jax.tree_util.tree_flatten_with_path(layers, is_leaf=is_layer_stats)
  out = {}
  for path, leaf in flat:
    name = layer_name(path_keys(path))
    if not is_layer_stats(leaf):
      kinds = ", ".join(k.stats_type.__name__ for k in layers_lib.registered())
      raise TypeError(
          f"curvature_stats: entry {name!r} is a {type(leaf).__name__}, expected one of "
          f"{kinds}; build statistics with thor_optax.flax.value_and_grad_with_stats.")
    out[name] = leaf
  return out


def captured_mask(stats: CurvatureStats | Mapping[str, Any]) -> Callable[[Any], Any]:
  """An optax mask of the parameters the capture preconditions, from its statistics.

  The preconditioners allocate Kronecker blocks, at ``tx.init``, for every layer a registered
  kind claims in the parameters, including layers the capture then never takes (a recurrent
  cell, a tied embedding, a weight-standardized conv). The statistics of one abstract capture
  say which layers it does take; ``precondition_mask=captured_mask(stats)`` (on every alias)
  keeps the preconditioner, and its state, to those::

    _, stats = jax.eval_shape(capture, params, x, y)  # no FLOPs
    tx = thor_optax.thor(0.1, 0.03, precondition_mask=thor_optax.captured_mask(stats))

  Args:
    stats: a :class:`CurvatureStats` (concrete or from ``jax.eval_shape``) or its ``layers``.

  Returns:
    ``mask(params) -> tree of bool`` (optax's callable-mask form): ``True`` at the leaves of
    the modules that have statistics, ``False`` elsewhere. Works on linen ``params`` dicts,
    boxed parameters and NNX ``nnx.State`` trees alike (leaves matched by module path).

  Raises:
    TypeError: as :func:`flatten_layer_stats`, if ``stats`` is not a tree of layer statistics.

  Source: this project; the mask is optax's callable-mask form (``optax.masked``).
  """
  names = frozenset(flatten_layer_stats(stats))

  def mask(params: Any) -> Any:
    return jax.tree_util.tree_map_with_path(
        lambda path, _: layer_name(path_keys(path)[:-1]) in names, params)

  return mask


@dataclasses.dataclass(frozen=True)
class CapturedLayers:
  """The layers a capture takes and how: the ``layers=`` of the preconditioners and aliases.

  Attributes:
    layers: ``((layer name, kind name, hint), ...)`` sorted by name; ``hint`` is the kind's
      static facts of the layer's statistics (``LayerKind.hint``: for a ``DenseGeneral``
      kernel, how many of its axes are inputs).
  """

  layers: tuple[tuple[str, str, tuple], ...]

  @property
  def kinds(self) -> dict[str, tuple[str, tuple]]:
    """``{layer name: (kind name, hint)}``."""
    return {name: (kind, hint) for name, kind, hint in self.layers}


def captured_layers(stats: CurvatureStats | Mapping[str, Any]) -> CapturedLayers:
  """The capture's layout of the layers, for ``layers=`` of every preconditioner and alias.

  The preconditioners lay out their state at ``tx.init``, which sees only parameter shapes;
  some kernels' shapes do not say how the model applies them (an attention projection
  ``nn.DenseGeneral(use_bias=False)`` kernel ``(d, H, h)`` could be a stack of ``d`` dense
  layers), and some claimed layers are never captured (a recurrent cell). The statistics of one
  abstract capture say both::

    _, stats = jax.eval_shape(capture, params, x, y)  # no FLOPs
    tx = thor_optax.thor(0.1, 0.03, layers=thor_optax.captured_layers(stats))

  Args:
    stats: a :class:`CurvatureStats` (concrete or from ``jax.eval_shape``) or its ``layers``.

  Returns:
    a hashable :class:`CapturedLayers`: the optimizer then keeps curvature for exactly these
    layers, each laid out as the capture took it; other parameters pass through unchanged.

  Raises:
    TypeError: as :func:`flatten_layer_stats`, if ``stats`` is not a tree of layer statistics.

  Source: this project (what kfac-jax's graph matcher finds by tracing the loss, read here from
  the statistics of one capture).
  """
  found = []
  for name, layer in sorted(flatten_layer_stats(stats).items()):
    kind = layers_lib.kind_of_stats(layer)
    found.append((name, kind.name, tuple(kind.hint(layer))))
  return CapturedLayers(tuple(found))


def path_keys(path: tuple[Any, ...]) -> tuple[str, ...]:
  """A pytree key path as plain strings (``(DictKey('a'), DictKey('b'))`` -> ``('a', 'b')``).

  Integer keys (``nnx.List`` items) become digits (``DictKey(0)`` -> ``'0'``). A trailing
  ``GetAttrKey('value')``, the child of a box, is dropped: of a Flax NNX ``Variable`` (an
  ``nnx.State`` of ``Param`` leaves, as ``nnx.Optimizer`` passes to ``tx.init``) or of a linen
  ``nn.Partitioned`` / ``nn.LogicallyPartitioned`` (``model.init`` with
  ``nn.with_partitioning``), so that a parameter has the same path whether it is boxed or a
  plain array. The module of a leaf is therefore ``path_keys(path)[:-1]``, never
  ``path_keys(path[:-1])``.
  """
  if (path and isinstance(path[-1], jax.tree_util.GetAttrKey)
      and path[-1].name == "value"):
    path = path[:-1]
  return tuple(jax.tree_util.keystr((k,), simple=True) for k in path)


ROOT_NAME = layers_lib.base.ROOT_NAME


def layer_name(keys: tuple[Any, ...]) -> str:
  """A module path as the layer name used in statistics, state and messages.

  ``('Block_0', 'Dense_1')`` -> ``'Block_0/Dense_1'`` (integer keys as digits); the parameters
  of the model's own root module (a bare ``nn.Dense`` given as the model) are named
  ``'(root)'``.
  """
  return "/".join(str(k) for k in keys) or ROOT_NAME


@dataclasses.dataclass(frozen=True)
class MaskedModules:
  """The modules ``optax.masked`` / ``optax.partition`` hid from a transform, from the key
  paths of the ``optax.MaskedNode`` leaves of its updates; ``name in masked`` for a layer name.

  optax accepts a mask that is a prefix of the parameter tree, so a ``MaskedNode`` stands for
  one parameter (a full-tree mask: ``('Dense_1', 'kernel')`` hides ``'Dense_1'``), or for a
  module or a subtree of modules (a prefix mask: ``('Block_0',)`` hides ``'Block_0/Dense_0'``
  and every other layer below it; ``()``, the whole tree, hides every layer).
  """

  paths: frozenset = frozenset()

  def __contains__(self, name: str) -> bool:
    for keys in self.paths:
      subtree = "/".join(str(k) for k in keys)
      if (not keys or name == subtree or name.startswith(subtree + "/")
          or name == layer_name(keys[:-1])):
        return True
    return False
