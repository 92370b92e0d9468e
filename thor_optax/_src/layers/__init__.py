"""The registry of layer kinds: capture, the transforms, micro-batches and weight rescaling
loop over it.

Each kind is one module of this package (``dense.py``, ``conv.py``, ``conv_transpose.py``,
``dense_general.py``, ``einsum.py``, ``embed.py``, ``norm.py``, ``matmul.py``,
``channel_affine.py``, ``lookup.py``; the last three read a module's call traced alone,
``traced.py``)
holding a :class:`~thor_optax._src.layers.base.LayerKind`. Kinds are tried in registry order;
a kind registered by a user with :func:`register_layer_kind` is tried before the built-in ones,
so it can take over modules (a subclass of ``nn.Conv`` whose kernel is transformed in
``__call__``, say) or parameters a built-in kind would claim.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping, Optional

from thor_optax._src.layers import base
from thor_optax._src.layers import channel_affine
from thor_optax._src.layers import conv
from thor_optax._src.layers import conv_transpose
from thor_optax._src.layers import dense
from thor_optax._src.layers import dense_general
from thor_optax._src.layers import einsum
from thor_optax._src.layers import embed
from thor_optax._src.layers import lookup
from thor_optax._src.layers import matmul
from thor_optax._src.layers import norm

LayerKind = base.LayerKind
LayerSpec = base.LayerSpec

# ``ConvTranspose`` after ``Conv``: its statistics are ``ConvStats``, read by ``Conv``.
_BUILTIN: tuple[base.LayerKind, ...] = (dense.Dense(), conv.Conv(), conv_transpose.ConvTranspose(),
                                         dense_general.DenseGeneral(), einsum.Einsum(),
                                         embed.Embed(), norm.Norm(), matmul.Matmul(),
                                         channel_affine.ChannelAffine(), lookup.Lookup())
_user: list[base.LayerKind] = []


def registered() -> tuple[base.LayerKind, ...]:
  """All kinds in the order they are tried: user kinds (newest first), then built-in ones.

  Returns:
    a tuple of :class:`LayerKind` instances; the built-in ones last, in the order ``Dense``,
    ``Conv``, ``ConvTranspose``, ``DenseGeneral``, ``Einsum``, ``Embed``, ``Norm``,
    ``Matmul``, ``ChannelAffine``, ``Lookup``.

  Raises:
    Nothing.

  Source: this project (one class per layer kind behind one interface, as kfac-jax's
  ``curvature_blocks``).
  """
  return tuple(_user) + _BUILTIN


def register_layer_kind(kind: base.LayerKind) -> base.LayerKind:
  """Registers a layer kind; it is tried before every kind registered earlier.

  Args:
    kind: an instance of a :class:`LayerKind` subclass with a unique ``name``, a
      ``stats_type`` (a dataclass registered with ``jax.tree_util.register_dataclass``), its
      ``example_axes``, the module classes it matches and :meth:`LayerKind.claim`; kinds with
      Kronecker factors also define ``input_rows`` (and ``kernel_matrix`` /
      ``kernel_from_matrix`` when the weight is not already ``(d_in..., d_out)``).

  Returns:
    ``kind``, so that it can be used as a decorator of an instance.

  Raises:
    TypeError: if ``kind`` is not a ``LayerKind`` instance, its ``linen_modules`` /
      ``nnx_modules`` are not tuples of classes, its ``stats_type`` is not a dataclass, its
      ``weight`` is not a string, or its ``example_axes`` are empty or name a key that is no
      field of ``stats_type`` (a claim that is not a :class:`Claim` or does not fit the weight
      is rejected when the optimizer lays the layer out, naming the kind and the layer).
    ValueError: if its ``name`` is empty or already registered, or its ``stats_type`` is
      another kind's with other ``example_axes``.

  Source: this project (one class per layer kind behind one interface, as kfac-jax's
  ``curvature_blocks``; a kind's factors are K-FAC's, Martens & Grosse, ICML 2015).
  """
  if not isinstance(kind, base.LayerKind):
    raise TypeError(f"register_layer_kind needs a LayerKind instance, got {kind!r}; subclass "
                    "thor_optax.LayerKind and pass an instance.")
  _check_kind_attributes(kind)
  if not kind.name or any(k.name == kind.name for k in registered()):
    raise ValueError(f"register_layer_kind: the name {kind.name!r} is empty or taken; "
                     f"registered: {[k.name for k in registered()]}.")
  if any(k.stats_type is kind.stats_type and dict(k.example_axes) != dict(kind.example_axes)
         for k in registered()):
    raise ValueError(f"register_layer_kind: {kind.stats_type.__name__} is the statistics type of "
                     "another kind with other example_axes; give the new kind its own dataclass.")
  _user.insert(0, kind)
  return kind


def _check_kind_attributes(kind: base.LayerKind) -> None:
  """Raises ``TypeError`` naming the attribute of ``kind`` that does not have its type."""
  where = f"register_layer_kind({type(kind).__name__}())"
  for attr in ("linen_modules", "nnx_modules"):
    value = getattr(kind, attr)
    if not isinstance(value, tuple) or not all(isinstance(c, type) for c in value):
      raise TypeError(f"{where}: {attr} must be a tuple of module classes (e.g. "
                      f"(MyModule,), or () for none), got {value!r}.")
  if not (isinstance(kind.stats_type, type) and dataclasses.is_dataclass(kind.stats_type)):
    raise TypeError(f"{where}: stats_type must be a dataclass registered with "
                    f"jax.tree_util.register_dataclass (or a built-in kind's, such as "
                    f"thor_optax.DenseStats), got {kind.stats_type!r}.")
  if not isinstance(kind.weight, str):
    raise TypeError(f"{where}: weight must be the name of the weight leaf ('kernel', 'w'), "
                    f"got {kind.weight!r}.")
  fields = {f.name for f in dataclasses.fields(kind.stats_type)}
  if not kind.example_axes or not set(kind.example_axes) <= fields:
    raise TypeError(f"{where}: example_axes must map fields of {kind.stats_type.__name__} "
                    f"({sorted(fields)}) to their example axis, got {dict(kind.example_axes)!r}.")


def check_claim(kind: base.LayerKind, path: tuple[str, ...], shapes: Mapping[str, tuple],
                found: Any, hint: tuple = ()) -> None:
  """Raises ``TypeError`` / ``ValueError`` naming the kind and the layer when a claim is not a
  :class:`Claim`, or names factor dimensions that do not fit the kind's weight leaf as a
  ``(d_in (+1 bias), d_out)`` matrix (a user kind whose ``claim`` swapped them, or whose
  ``weight`` names no leaf); ``hint``: the capture's, which may name the leaves
  (:meth:`LayerKind.leaf_names`)."""
  where = (f"layer kind {kind.name!r} ({type(kind).__name__}) claimed layer "
           f"{'/'.join(map(str, path)) or '(root)'} with leaves {dict(shapes)}")
  if not isinstance(found, base.Claim):
    raise TypeError(f"{where}: claim must return a thor_optax.layers.Claim or None, got "
                    f"{found!r}.")
  if found.a_dim is None and found.g_dim is None:
    return
  weight = kind.leaf_names(hint)[0]
  if weight not in shapes:
    raise ValueError(f"{where}: its weight leaf {weight!r} is not among them; set the "
                     "kind's weight attribute to the name of the leaf it owns.")


def unregister_layer_kind(kind: base.LayerKind) -> None:
  """Removes a kind added by :func:`register_layer_kind`; the other kinds keep their order.

  Args:
    kind: the instance that was passed to :func:`register_layer_kind` (kinds are compared by
      identity: another instance of the same class is another kind).

  Raises:
    ValueError: if ``kind`` is not a registered user kind (a built-in kind, an instance never
      registered, or one already removed).

  Source: this project.
  """
  if kind not in _user:
    raise ValueError(f"unregister_layer_kind: {kind!r} was not registered by the user.")
  _user.remove(kind)


def kind_of_module(module: Any) -> Optional[base.LayerKind]:
  """The first registered kind matching a linen or NNX module instance, or ``None``."""
  return next((k for k in registered() if k.matches(module)), None)


def kinds_of_module(module: Any) -> tuple[base.LayerKind, ...]:
  """Every registered kind matching a linen or NNX module instance, in the order they are
  tried (a module of any class holding one weight: ``'matmul'`` and ``'channel_affine'``, whose
  plans of its call decide)."""
  return tuple(k for k in registered() if k.matches(module))


def kind_named(name: str) -> base.LayerKind:
  """The registered kind called ``name``.

  Raises:
    ValueError: if no registered kind has that name (a user kind not registered in this
      process).
  """
  for kind in registered():
    if kind.name == name:
      return kind
  raise ValueError(f"no layer kind named {name!r} is registered (registered: "
                   f"{[k.name for k in registered()]}); register it with "
                   "thor_optax.register_layer_kind before building the optimizer.")


def kind_of_stats(stats: Any) -> Optional[base.LayerKind]:
  """The kind whose statistics type ``stats`` is an instance of, or ``None``."""
  return next((k for k in registered() if type(stats) is k.stats_type), None)


def is_layer_stats(x: Any) -> bool:
  """True for one layer's statistics (a leaf when flattening ``CurvatureStats.layers``)."""
  return kind_of_stats(x) is not None


def intercepted(api: str) -> Iterable[tuple[type, str]]:
  """``(class, method)`` pairs of every registered kind's ``'linen'`` or ``'nnx'`` modules."""
  for kind in registered():
    for cls in (kind.linen_modules if api == "linen" else kind.nnx_modules):
      for method in kind.methods:
        yield cls, method


def claim(path: tuple[str, ...], shapes: Mapping[str, tuple[int, ...]],
          stacked: bool = False) -> Optional[tuple[base.LayerKind, base.Claim]]:
  """The first kind claiming a module's leaves ``{name: shape}``, with its claim, or ``None``;
  ``stacked``: the shapes are one layer's of a stack (leading axes removed), which only kinds
  with :attr:`~base.LayerKind.stacks_from_shapes` may claim."""
  for kind in registered():
    if stacked and not kind.stacks_from_shapes:
      continue
    found = kind.claim(path, shapes)
    if found is not None:
      return kind, found
  return None
