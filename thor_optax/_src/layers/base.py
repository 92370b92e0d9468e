"""The interface of a layer kind: everything the package knows about one kind of layer.

A :class:`LayerKind` declares, in one place, what capture, the transforms, ``concatenate_stats``
and weight rescaling need about one kind of layer (Flax ``Dense``, ``Conv``, ``Embed``,
``BatchNorm``/``LayerNorm``/``GroupNorm``/``RMSNorm``, or a kind a user registers with
:func:`thor_optax.register_layer_kind`):

* **capture**: the Flax linen and NNX module classes it matches (:attr:`linen_modules`,
  :attr:`nnx_modules`), the methods that are intercepted, whether a call can be captured
  (:meth:`plan`) and the statistics container built from the recorded input (for a
  normalization layer ``x_hat``, the output of :meth:`unit_affine`) and output cotangents
  (:attr:`stats_type`, :meth:`make_stats`);
* **parameters**: which module parameters it owns (:meth:`claim`), from their names and shapes
  alone, since ``optax`` ``init`` sees nothing else;
* **curvature**: the rows behind its Kronecker factors and their scale (:meth:`factor_rows`,
  ``A = scale_A rows_A^T rows_A``), how the gradient leaves map to the ``(d_A, d_G)`` matrix the
  factors act on and back (:meth:`to_matrix`, :meth:`from_matrix`), the example axes of its
  statistics (:attr:`example_axes`, for ``concatenate_stats``), and any side curvature it keeps
  outside the block stacks (an embedding's diagonal ``A``, a normalization layer's unit-wise
  2x2 Fisher: :meth:`side_init`, :meth:`side_statistics`, :meth:`side_refresh`,
  :meth:`side_precondition`).

Kinds hold no arrays and no mutable state: they are static descriptions, compared by identity.

References:
  kfac-jax ``curvature_blocks``: one class per layer kind behind one interface.
  Martens & Grosse, K-FAC, ICML 2015, eq. 1 (``F ~ A (x) G``).
"""

from __future__ import annotations

import abc
import dataclasses
import inspect
import math
from typing import Any, Callable, Mapping, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from thor_optax._src import explicit


ROOT_NAME = "(root)"  # the name of the parameters of the model's own root module


class Claim(NamedTuple):
  """What a kind owns of one module's parameters (from :meth:`LayerKind.claim`).

  Attributes:
    a_dim: dimension of the input factor ``A`` kept in the block stacks, or ``None`` when the
      kind keeps no blocked ``A`` (embeddings: diagonal; normalization layers: none).
    g_dim: dimension of the output factor ``G`` in the block stacks, or ``None``.
    in_axes: how many leading axes of the weight are its input (``A``) side, the rest being its
      output (``G``) side; ``None``: all but the last (``nn.Dense``, HWIO convolutions). A
      ``DenseGeneral`` query kernel ``(d, H, h)`` has ``in_axes=1``, its output projection
      ``(H, h, d)`` ``in_axes=2``.
    groups: ``G > 1`` for a layer made of ``G`` independent layers side by side (a grouped
      convolution, ``feature_group_count=G``): ``a_dim`` and ``g_dim`` are then one group's,
      and every group has its own factors, laid out as a stack of ``G`` layers
      (:attr:`LayerSpec.groups`, :meth:`LayerKind.split_groups`).

  Source: this project; ``a_dim`` and ``g_dim`` are the sizes of K-FAC's ``A`` and ``G``
  (Martens & Grosse, ICML 2015), ``d_in (+1 for a bias)`` and ``d_out`` of the weight as a
  matrix.
  """

  a_dim: Optional[int]
  g_dim: Optional[int]
  in_axes: Optional[int] = None
  groups: int = 1


class FactorRows(NamedTuple):
  """A Kronecker factor given by scaled rows: ``F = scale * rows^T rows``.

  Attributes:
    rows: ``(R, d)``; ``R`` (examples x positions x samples) is static.
    scale: scalar, in the rows' dtype (``1 / M`` for a dense layer's ``A``).

  Source: K-FAC's ``A = E[a a^T]``, ``G = E[g g^T]`` (Martens & Grosse, ICML 2015) as the rows
  behind them, so that a factor with fewer rows than its dimension can be inverted in Woodbury
  form from its rows (SKFAC, Tang et al., CVPR 2021).
  """

  rows: jax.Array
  scale: jax.Array


@dataclasses.dataclass(frozen=True)
class LayerSpec:
  """One layer of a parameter tree, as a kind claimed it (static, hashable).

  Attributes:
    path: module path (keys from the parameter root to the dict holding the leaves).
    kind: the :class:`LayerKind` that claimed it.
    shapes: ``((leaf name, shape), ...)`` of the module's leaves, sorted by name.
    a: slot of the input factor ``A`` in the block stacks (``blocks.FactorSlot``), or ``None``.
    g: slot of the output factor ``G``, or ``None``.
    stack: ``()`` for one layer; ``(L,)`` (or more axes) for a stack of layers whose
      parameters carry these leading axes (``nn.scan`` over layers): ``shapes`` are then one
      layer's, and every layer of the stack has its own factors, statistics and side
      curvature, with the stack flattened to ``copies`` on a leading axis.
    in_axes: :attr:`Claim.in_axes`, the leading weight axes on the ``A`` side (``None``: all
      but the last).
    hint: the capture's static facts of the layer (:meth:`LayerKind.hint`) when the layout was
      made from them (``layers=captured_layers(stats)``), ``()`` otherwise.
    groups: :attr:`Claim.groups`. For ``G > 1`` the layer is laid out as a stack of its ``G``
      groups: ``stack`` ends with ``G`` (after the parameters' own stack axes, if any),
      ``shapes`` are one group's, and :meth:`flat_stack` splits the parameters and statistics
      into the groups with the kind's :meth:`LayerKind.split_groups` (they carry no group
      axis of their own).

  Source: this project; the slots are places in the stacks of uniform diagonal blocks of
  THOR's hardware-driven split (Chen et al., AAAI 2021).
  """

  path: tuple[str, ...]
  kind: "LayerKind"
  shapes: tuple[tuple[str, tuple[int, ...]], ...]
  a: Any = None
  g: Any = None
  stack: tuple[int, ...] = ()
  in_axes: Optional[int] = None
  hint: tuple = ()
  groups: int = 1

  @property
  def copies(self) -> int:
    """Number of layers in the stack (1 for a single layer; groups count as layers)."""
    return int(np.prod(self.stack, dtype=np.int64))

  @property
  def leading(self) -> tuple[int, ...]:
    """The stack axes the parameters and statistics carry (``stack`` without the groups)."""
    return self.stack[:len(self.stack) - 1] if self.groups > 1 else self.stack

  def one_layer(self) -> "LayerSpec":
    """The spec of one layer of a stack (itself for a single layer), for per-layer maths run
    under ``jax.vmap`` over the stack (one group of a grouped layer)."""
    if not self.stack:
      return self
    return dataclasses.replace(self, a=self.a and self.a.one_copy(),
                               g=self.g and self.g.one_copy(), stack=(), groups=1)

  def flat_stack(self, tree: Any) -> Any:
    """Every leaf of ``tree`` with the leading stack axes flattened to one, ``(copies, ...)``;
    a grouped layer's parameters or statistics are first split into its groups
    (:meth:`LayerKind.split_groups`), the groups after the parameters' stack axes.

    Raises:
      ValueError: naming the layer if a leaf does not start with the stack axes.
    """
    lead = self.leading

    def check(x):
      if tuple(x.shape[:len(lead)]) != lead:
        raise ValueError(
            f"layer {self.name!r} is a stack of layers (its parameters have the leading axes "
            f"{lead}), but an array of its statistics or state has shape {x.shape}; "
            "capture statistics with thor_optax.flax.value_and_grad_with_stats, which gives a "
            "scanned stack its statistics with the stack axes first. (A kernel whose shape "
            "does not say how the model applies it, such as a 3-D convolution's without bias, "
            "needs the capture's layout: layers=thor_optax.captured_layers(stats).)")
      return x
    tree = jax.tree.map(check, tree)
    if self.groups > 1:
      tree = self.kind.split_groups(tree, self.groups, len(lead))
    return jax.tree.map(lambda x: x.reshape((self.copies,) + x.shape[len(self.stack):]), tree)

  def unflat_stack(self, tree: Mapping[str, Any],
                   like: Mapping[str, Any]) -> dict[str, Any]:
    """Inverse of :meth:`flat_stack` for leaves: ``{name: (copies, ...)}`` back to the shapes
    of the leaves ``like`` (the groups of a grouped layer merged,
    :meth:`LayerKind.merge_groups`)."""
    tree = dict(tree)
    if self.groups > 1:
      lead = self.leading + (self.groups,)
      tree = self.kind.merge_groups({k: v.reshape(lead + v.shape[1:]) for k, v in tree.items()},
                                    self.groups, len(self.leading))
    return {k: v.reshape(like[k].shape) for k, v in tree.items()}

  @property
  def name(self) -> str:
    """``'/'``-joined module path, the layer's name in statistics, state and messages
    (``'(root)'`` for the root module's own parameters)."""
    return "/".join(self.path) or ROOT_NAME

  def shape(self, leaf: str) -> Optional[tuple[int, ...]]:
    """Shape of the module's leaf ``leaf``, or ``None``."""
    return dict(self.shapes).get(leaf)

  @property
  def kernel_shape(self) -> tuple[int, ...]:
    """Shape of the kind's weight leaf (``kernel``, ``embedding``, or ``scale``/``bias``;
    :meth:`LayerKind.leaf_names`)."""
    weight, bias = self.kind.leaf_names(self.hint)
    return self.shape(weight) or self.shape(bias)

  @property
  def split(self) -> int:
    """The number of leading weight axes on the input side (:attr:`in_axes`, default all but
    the last)."""
    return len(self.kernel_shape) - 1 if self.in_axes is None else self.in_axes

  @property
  def has_bias(self) -> bool:
    """Whether a ``bias`` leaf (:meth:`LayerKind.leaf_names`) with one entry per output of the
    weight sits beside it (its kind's claim checked its shape)."""
    bias = self.shape(self.kind.leaf_names(self.hint)[1])
    return bias is not None and math.prod(bias) == self.d_out

  @property
  def slots(self) -> tuple[Any, ...]:
    """The factor slots in the block stacks (``A`` then ``G``)."""
    return tuple(s for s in (self.a, self.g) if s is not None)

  @property
  def d_in(self) -> int:
    """Input dimension of the weight as a matrix (conv: ``C_in k_h k_w``), bias excluded."""
    return self.kind.matrix_dims(self)[0]

  @property
  def d_out(self) -> int:
    """Output dimension of the weight as a matrix (the product of its output axes)."""
    return self.kind.matrix_dims(self)[1]


_CONSTANTS = (str, bytes, bool, int, float, complex, type(None))


def input_position(args: tuple, kwargs: dict) -> Any:
  """Where a layer call's input is: the index of its first positional argument that is not a
  string (the equation Gemma's linen ``Einsum(eqn, x)`` takes first), else the keyword
  ``'inputs'``, ``'x'`` or ``'query'``.

  Raises:
    ValueError: if there is none.
  """
  for i, a in enumerate(args):
    if not isinstance(a, str):
      return i
  for key in ("inputs", "x", "query"):
    if key in kwargs:
      return key
  raise ValueError(f"cannot find the input among {len(args)} positional and keyword arguments "
                   f"{sorted(kwargs)}")


def primary_input(args: tuple, kwargs: dict) -> Any:
  """A layer call's input (``inputs`` / ``x``; :func:`input_position`), positional or not."""
  at = input_position(args, kwargs)
  return args[at] if isinstance(at, int) else kwargs[at]


def with_input(args: tuple, kwargs: dict, x: Any) -> tuple[tuple, dict]:
  """The call's arguments with its input (:func:`input_position`) replaced by ``x``."""
  at = input_position(args, kwargs)
  if isinstance(at, int):
    return args[:at] + (x,) + args[at + 1:], kwargs
  return args, {**kwargs, at: x}


def one_array_input(args: tuple, kwargs: dict) -> bool:
  """Whether a call's input is one array and its other arguments, if any, Python constants
  (strings, numbers, booleans, ``None``): a call that :func:`with_input` reproduces on another
  value of the input."""
  try:
    at = input_position(args, kwargs)
  except ValueError:
    return False
  x = args[at] if isinstance(at, int) else kwargs[at]
  others = [a for i, a in enumerate(args) if i != at]
  others += [v for k, v in kwargs.items() if k != at]
  return isinstance(x, jax.Array) and all(type(v) in _CONSTANTS for v in others)


class Plan(NamedTuple):
  """Outcome of :meth:`LayerKind.plan` for one captured module call.

  Attributes:
    meta: static keyword arguments of :meth:`LayerKind.make_stats` (a dict), or ``None`` if the
      call is not captured.
    reason: why it is not captured (listed in ``CurvatureStats.unhandled``); ``''`` with
      ``meta=None`` means there is nothing to precondition (no parameters), silently skipped.

  Source: this project.
  """

  meta: Optional[dict]
  reason: str = ""


class LayerKind(abc.ABC):
  """One kind of layer (subclass it, then :func:`thor_optax.register_layer_kind`).

  Class attributes:
    name: the kind's name (``'dense'``, ``'conv'``, ...), unique in the registry.
    stats_type: the statistics container (a ``jax.tree_util.register_dataclass`` dataclass).
    example_axes: ``{field: axis}``, the example axis of every array field of ``stats_type``.
    linen_modules, nnx_modules: module classes matched by ``isinstance``.
    methods: names of the intercepted methods; statistics come from ``'__call__'``, the others
      are only recorded (e.g. ``Embed.attend``, to see a tied embedding).
    weight: name of the weight leaf (``'kernel'``, ``'embedding'``).
    normalized_input: whether capture records ``x_hat`` (the input normalized, before scale and
      bias) instead of the raw input (normalization layers; such a kind defines
      :meth:`unit_affine`).
    he_rescaled: whether ``rescale_weight_norms`` caps the weight's norm (SP-NGD).
    shares_weights: whether the kind joins several uses of one layer's weights in a forward
      pass into one statistics (:meth:`make_shared_stats`; weight sharing).
    reduces_steps: whether statistics made from an input averaged over a loop's iterations and
      output cotangents summed over them are the kind's K-FAC-reduce (statistics linear in the
      recorded input: dense, ``DenseGeneral``, einsum), so that a layer whose weights a lifted
      loop applies at every iteration (an ``nn.RNN`` cell) is captured
      (``step_sharing.py``).
    gradient_from_rows: whether the weight's gradient matrix (:meth:`to_matrix`) is
      ``scale a^T g`` with ``a, scale`` from :meth:`input_rows` and ``g`` from
      :meth:`cotangent_rows`, row for row, when the statistics are an empirical Fisher's with
      positions not reduced (dense, ``DenseGeneral``, einsum): a plain step may then
      precondition the layer in sample space (``sample_space.py``).
    integer_inputs: whether the recorded input is integer by nature (an embedding's ids); for
      the other kinds an integer or boolean input (``uint8`` images) is recorded cast to the
      cotangents' float dtype, as Flax casts it before the product.
    stacks_from_shapes: whether the kind may claim, from parameter shapes alone, the leaves
      of a module with leading axes removed, as a stack of layers (``nn.scan`` over layers;
      default ``True``). ``False`` for a kind that claims small shapes of any leaf names (the
      ``'channel_affine'`` kind's vectors): any larger array would otherwise be claimed as a
      stack of them; such stacks are laid out from the capture's statistics.
    live_plan: whether the kind plans each call during it (:meth:`plan_call`, reading the
      module's variables, which linen keeps only while the model runs, and the input itself):
      the capture keeps those plans instead of planning after the pass, records only calls
      on one array, and captures a module only when all its calls' plans agree (the
      ``'matmul'`` kind, which traces the call).

  Subclassing raises nothing; :func:`thor_optax.register_layer_kind` checks the attributes
  (``TypeError`` / ``ValueError``), and the methods say what they raise.

  Source: this project, after kfac-jax's ``curvature_blocks`` (one class per layer kind behind
  one interface); the factors are K-FAC's (Martens & Grosse, ICML 2015), KFC's for
  convolutions (Grosse & Martens, ICML 2016).
  """

  name: str = ""
  stats_type: type = type(None)
  example_axes: Mapping[str, int] = {}
  linen_modules: tuple[type, ...] = ()
  nnx_modules: tuple[type, ...] = ()
  methods: tuple[str, ...] = ("__call__",)
  weight: str = "kernel"
  normalized_input: bool = False
  he_rescaled: bool = False
  shares_weights: bool = False
  reduces_steps: bool = False
  gradient_from_rows: bool = False
  integer_inputs: bool = False
  stacks_from_shapes: bool = True
  live_plan: bool = False

  def __repr__(self) -> str:
    return f"<layer kind {self.name!r}>"

  # ---- capture -------------------------------------------------------------------------------

  def matches(self, module: Any) -> bool:
    """Whether ``module`` (a linen or NNX module instance) is of this kind."""
    return isinstance(module, self.linen_modules + self.nnx_modules)

  def overridden(self, module: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(methods, fields)``: the methods (the intercepted ones and linen's ``param``) that
    ``module``'s class replaces in the registered class it matches, and the
    :data:`OPERATION_FIELDS` it is given (:func:`replaced_operations`). Either way the weight
    it applies may not be its parameter (a weight-standardized ``nn.Conv`` overriding
    ``param``, a ``Dense`` scaling its kernel in its ``dot_general``), so capture lists it."""
    base_cls = next((c for c in self.linen_modules + self.nnx_modules
                     if isinstance(module, c)), None)
    if base_cls is None:
      return (), ()
    names = self.methods + ("param",)
    methods = tuple(n for n in names if hasattr(base_cls, n)
                    and getattr(type(module), n) is not getattr(base_cls, n))
    return methods, replaced_operations(module, base_cls)

  def plan(self, module: Any, methods: tuple[str, ...],
           input_shape: tuple[int, ...]) -> Plan:
    """Whether a call is captured: ``methods`` are those seen for the module in one pass."""
    del module, methods, input_shape
    return Plan(meta={})

  def intercepts(self, module: Any, method: str) -> bool:
    """Whether the capture takes a call of ``module``'s ``method`` as a use of the layer
    (default: ``method`` is one of :attr:`methods`; the kinds of any class: any method of
    the module's own class taking an input, which :meth:`plan_method` plans)."""
    del module
    return method in self.methods

  def plan_method(self, module: Any, method: str, args: tuple, kwargs: dict
                  ) -> Optional[Plan]:
    """The plan of one call of ``module``'s ``method`` (a :attr:`live_plan` kind's), or
    ``None`` when the call is no use of the layer's weights for this kind. Default:
    :meth:`plan_call` for ``__call__``, ``None`` for another method."""
    return self.plan_call(module, args, kwargs) if method == "__call__" else None

  def join_plans(self, plans: list) -> Plan:
    """The plan of a :attr:`live_plan` kind's module from its calls' plans (:class:`Plan` s, in
    call order): the plan they share, or, when they differ (one call might compute another
    product, or none), a refusal naming them. A kind whose uses play different roles (a
    table's lookup and its tied ``decode``) overrides it."""
    refused = next((p for p in plans if p.meta is None), None)
    if refused is not None or not plans:
      return refused or Plan(None, "no call of it was planned")
    if any(p != plans[0] for p in plans):
      return Plan(None, f"its {len(plans)} calls apply its weight differently "
                  f"({sorted({str(p.meta) for p in plans})})")
    return plans[0]

  def plan_call(self, module: Any, args: tuple, kwargs: dict) -> Plan:
    """The plan of one ``__call__`` with arguments ``args``, ``kwargs`` (the layer's input is
    :func:`primary_input`), made during the call with the module live (the capture keeps it
    for a :attr:`live_plan` kind). Default: :meth:`plan` of the input's shape."""
    return self.plan(module, ("__call__",), jnp.shape(primary_input(args, kwargs)))

  def transposed_use(self, leaf: str, shape: tuple[int, ...]
                     ) -> Optional[tuple[str, Optional[Plan]]]:
    """For a layer whose weight leaf ``leaf`` (of ``shape``) is given transposed, as the kernel,
    to a ``nn.Dense`` applied with ``.apply()`` inside the model (Hugging Face's tied output
    projection, ``tied_outputs.py``): ``(method, plan)`` as which that call joins the layer's
    uses (``'attend'`` for an embedding; the plan of a :attr:`live_plan` kind, else
    ``None``), or ``None`` (default) when the kind does not join such a use: the layer is then
    listed (weight sharing)."""
    del leaf, shape
    return None

  def unit_affine(self, module: Any, dtype: jnp.dtype, meta: Mapping[str, Any]) -> Any:
    """For a :attr:`normalized_input` kind: a copy of ``module`` without its affine map, whose
    output is ``x_hat``, made before the layer's call; ``meta``: the layer's plan
    (:attr:`Plan.meta`).

    Linen: an unbound module (capture applies it with the layer's non-parameter collections as
    the layer read them, ``copy.apply(state, *args, mutable=True, **kwargs)``) computing in
    ``dtype``, the layer's output dtype. NNX: a module with its own variables, called with the
    arguments of the layer's call (``dtype`` is the layer's output dtype).

    Raises:
      NotImplementedError: for a kind that does not define it.
    """
    del module, dtype, meta
    raise NotImplementedError(f"layer kind {self.name!r} sets normalized_input but does not "
                              "define unit_affine")

  def make_stats(self, inputs: jax.Array, cotangents: jax.Array, **meta: Any) -> Any:
    """The statistics of one call: ``inputs`` as recorded (``(N, ...)``; ``x_hat`` for
    :attr:`normalized_input` kinds) and per-example output cotangents ``(S, N, ...)``."""
    return self.stats_type(inputs=inputs, cotangents=cotangents, **meta)

  def make_shared_stats(self, methods: tuple[str, ...], inputs: tuple[jax.Array, ...],
                        cotangents: tuple[jax.Array, ...], **meta: Any) -> Any:
    """The statistics of a layer whose weights are used several times in one forward pass
    (:attr:`shares_weights` kinds): ``methods``, ``inputs`` and ``cotangents`` of every use, in
    call order, each as :meth:`make_stats` takes them. Eschenhagen et al. 2023: the uses are
    positions sharing the weight, folded like any other positions (:meth:`per_loss_term`).

    Raises:
      NotImplementedError: for a kind that does not share weights.
    """
    del methods, inputs, cotangents, meta
    raise NotImplementedError(f"layer kind {self.name!r} does not join shared uses")

  def output_positions(self, meta: Mapping[str, Any], out_ndim: int) -> tuple[int, ...]:
    """The axes of an output of rank ``out_ndim`` (after the example axis 0) that are positions
    sharing the weight, over which K-FAC-reduce sums the output cotangents; ``meta``: the
    plan's. The discovery pass shifts the output along them to find attention keys
    (``attention_keys.py``). Default: ``()`` (positions not folded)."""
    del meta, out_ndim
    return ()

  def per_loss_term(self, stats: Any, num_terms: int, weight_sharing: str) -> Any:
    """The statistics of one call for a mean loss of ``num_terms`` terms.

    A kind whose weights are shared over positions (a dense layer over a sequence) overrides
    this to fold the positions as ``weight_sharing`` says (``'expand'`` or ``'reduce'``, or
    ``'auto'``: :func:`resolve_weight_sharing`), Eschenhagen et al. 2023:

    * expand: the example axis regrouped to the ``M`` loss terms (:func:`regroup_examples`), so
      that ``A = (1/M) sum_{n,t} a a^T``: a per-position loss (``M = N T``) gets the curvature
      of the batch flattened to ``(N T, d)``, a per-example loss (``M = N``) KFC's;
    * reduce: per example, inputs averaged and cotangents summed over the positions
      (:func:`reduce_positions`).

    Default: unchanged.
    """
    del num_terms, weight_sharing
    return stats

  # ---- parameters ----------------------------------------------------------------------------

  @abc.abstractmethod
  def claim(self, path: tuple[str, ...],
            shapes: Mapping[str, tuple[int, ...]]) -> Optional[Claim]:
    """The factors of the module at ``path`` with leaves ``{name: shape}``, or ``None`` if it
    is not this kind's (a user kind may look at the path: linen names modules after their class,
    ``'Projection_0'``)."""
    del path, shapes

  def claim_captured(self, path: tuple[str, ...], shapes: Mapping[str, tuple[int, ...]],
                     hint: tuple) -> Optional[Claim]:
    """The factors of a module the capture took as this kind, given :meth:`hint` of its
    statistics (``thor_optax.captured_layers``): exact where shapes alone are ambiguous (a
    ``DenseGeneral`` kernel without bias). Default: :meth:`claim`."""
    del hint
    return self.claim(path, shapes)

  def leaf_names(self, hint: tuple) -> tuple[str, Optional[str]]:
    """``(weight leaf, bias leaf)`` names of a layer's parameters, given the capture's
    :meth:`hint` of its statistics (``()`` for a layout from shapes alone). Default:
    :attr:`weight` and ``'bias'``; a kind whose names are in the hint overrides it."""
    del hint
    return self.weight, "bias"

  def hint(self, stats: Any) -> tuple:
    """Static facts of one layer's statistics that fix its claim (a hashable tuple; default
    ``()``), for :meth:`claim_captured`."""
    del stats
    return ()

  def split_groups(self, tree: Any, groups: int, axis: int) -> Any:
    """A grouped layer (:attr:`Claim.groups`) as ``groups`` layers: its parameter leaves or
    its statistics with a new group axis at ``axis`` (after the ``axis`` leading stack axes).

    Default: every array's last axis holds the features of the groups one after another
    (a grouped convolution's input channels, output channels, kernel output axis and bias),
    and is split into ``(groups, last / groups)``. A kind whose statistics carry static facts
    about the grouping also resets them to one group's.
    """
    def split(x):
      x = x.reshape(x.shape[:-1] + (groups, x.shape[-1] // groups))
      return jnp.moveaxis(x, -2, axis)
    return jax.tree.map(split, tree)

  def merge_groups(self, tree: Mapping[str, jax.Array], groups: int,
                   axis: int) -> dict[str, jax.Array]:
    """Inverse of :meth:`split_groups` for parameter leaves (the group axis at ``axis``)."""
    del groups

    def merge(x):
      x = jnp.moveaxis(x, axis, -2)
      return x.reshape(x.shape[:-2] + (-1,))
    return {k: merge(v) for k, v in tree.items()}

  # ---- Kronecker factors ---------------------------------------------------------------------

  def check_stats(self, spec: LayerSpec, stats: Any) -> None:
    """Raises ``ValueError`` naming the layer if ``stats`` do not fit its weight."""
    if not isinstance(stats, self.stats_type):
      raise ValueError(
          f"the statistics (curvature_stats or gradient_stats) for layer {spec.name!r} "
          f"({self.leaf_names(spec.hint)[0]} shape {spec.kernel_shape}): got "
          f"{type(stats).__name__}, expected "
          f"{self.stats_type.__name__}: the optimizer laid the layer out as a {self.name!r} "
          f"layer{f' stack {spec.stack}' if spec.stack else ''} from its parameter shapes "
          "alone, which do not say how the model applies it (a kernel without bias of "
          "nn.DenseGeneral, nn.Einsum, a 1-D/3-D or grouped convolution, a kernel applied "
          "transposed such as GPT-2's Conv1D). Give the optimizer "
          "the capture's layout: layers=thor_optax.captured_layers(stats), with stats from "
          "jax.eval_shape of the capture (README, 'Transformers').")

  def input_rows(self, spec: LayerSpec, stats: Any, dtype: jnp.dtype, *, sampling: Any = None,
                 key: Optional[jax.Array] = None) -> FactorRows:
    """``(rows, scale)`` with ``A = scale rows^T rows`` (kinds with a blocked ``A``; a kind
    with a diagonal ``A`` returns its ``(d_A,)`` values).

    Raises:
      NotImplementedError: for a kind whose claims have no ``A`` or ``G`` factor.
    """
    raise NotImplementedError(f"layer kind {self.name!r} has no Kronecker factors; its claim "
                              "must give a_dim=None and g_dim=None")

  def input_moments(self, spec: LayerSpec, stats: Any, dtype: jnp.dtype, *,
                    sampling: Any = None) -> Optional[tuple[jax.Array, jax.Array]]:
    """``(sums of squares, sums)`` of the columns of :meth:`input_rows`' rows, ``(d_A,)``
    each, computed without forming the rows, or ``None`` (default: the check step reads them
    from the rows).

    A kind whose rows cost much more than their inputs (a convolution's patches) gives them:
    a check step then takes the block traces of ``A`` from them, and forms the rows only in
    the branches that multiply out blocks due, when those run.
    """
    del spec, stats, dtype, sampling
    return None

  def cotangent_rows(self, spec: LayerSpec, stats: Any, dtype: jnp.dtype, *,
                     sampling: Any = None, key: Optional[jax.Array] = None) -> FactorRows:
    """``(rows, scale)`` with ``G = scale rows^T rows``: per-example cotangents ``g``, ``G``
    averaging over the ``N T`` examples x positions and summing over the ``S`` samples."""
    g = stats.cotangents
    n_positions = int(np.prod(g.shape[1:-1]))
    rows = explicit.flatten_rows(g).astype(dtype)
    return FactorRows(rows, jnp.asarray(1.0 / n_positions, dtype))

  def to_matrix(self, spec: LayerSpec, leaves: Mapping[str, jax.Array],
                dtype: jnp.dtype) -> jax.Array:
    """The gradient leaves as the ``(d_A, d_G)`` matrix the factors act on (bias row last)."""
    x = self.kernel_matrix(leaves[self.weight]).reshape(spec.d_in, spec.d_out).astype(dtype)
    if spec.has_bias:
      x = jnp.concatenate([x, leaves["bias"].reshape(1, -1).astype(x.dtype)], axis=0)
    return x

  def from_matrix(self, spec: LayerSpec, matrix: jax.Array,
                  leaves: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """Inverse of :meth:`to_matrix`: ``{leaf name: new leaf}`` in the leaves' dtypes."""
    out = {self.weight: self.kernel_from_matrix(matrix[:spec.d_in], spec.kernel_shape)
           .astype(leaves[self.weight].dtype)}
    if spec.has_bias:
      out["bias"] = matrix[spec.d_in].reshape(spec.shape("bias")).astype(leaves["bias"].dtype)
    return out

  def matrix_dims(self, spec: LayerSpec) -> tuple[int, int]:
    """``(d_in, d_out)`` of the weight as a matrix, bias excluded (default: the products of its
    leading :attr:`LayerSpec.split` axes and of the others)."""
    shape = spec.kernel_shape
    return int(np.prod(shape[:spec.split])), int(np.prod(shape[spec.split:]))

  def kernel_matrix(self, kernel: jax.Array) -> jax.Array:
    """The weight as a ``(d_in, d_out)`` matrix (default: all axes but the last are inputs)."""
    return kernel.reshape(-1, kernel.shape[-1])

  def kernel_from_matrix(self, matrix: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Inverse of :meth:`kernel_matrix`."""
    return matrix.reshape(shape)

  # ---- side curvature (outside the block stacks) ---------------------------------------------

  def side_init(self, spec: LayerSpec, dtype: jnp.dtype, method: Any,
                accumulator: Any) -> Optional[Any]:
    """State of the layer's side curvature, or ``None`` if it has none."""
    del spec, dtype, method, accumulator
    return None

  def side_statistics(self, spec: LayerSpec, stats: Any, dtype: jnp.dtype) -> Optional[Any]:
    """What the side curvature of a kind without block factors is built from, or ``None``.

    A pytree of arrays that are averages over the batch's examples (a normalization layer's
    ``(C, 2, 2)`` Fisher), in ``dtype``. The check step averages it across replicas under
    ``axis_name`` (``jax.lax.pmean``, exact for equal shards: data parallelism) and passes it to
    :meth:`side_refresh` as ``factors``. Default: ``None`` (the kind refreshes from ``stats``
    alone, which under ``axis_name`` are this replica's).
    """
    del spec, stats, dtype
    return None

  def side_refresh(self, spec: LayerSpec, stats: Any, state: Any, factors: Any,
                   damping: jax.Array, method: Any, accumulator: Any) -> Any:
    """The side curvature after a check step with ``stats`` (``factors``: the layer's
    :class:`LayerFactors` for a kind with block factors, else its :meth:`side_statistics`
    averaged across replicas; ``damping``: ``lambda``)."""
    del spec, stats, factors, damping, method, accumulator
    return state

  def a_operator(self, spec: LayerSpec, state: Any, method: Any) -> Any:
    """The damped inverse of ``A`` when it is side curvature (a diagonal ``A``), else ``None``."""
    del spec, state, method
    return None

  def side_precondition(self, spec: LayerSpec, leaves: Mapping[str, jax.Array], state: Any,
                        dtype: jnp.dtype) -> dict[str, jax.Array]:
    """Gradient leaves preconditioned by side curvature alone (kinds without block factors)."""
    raise NotImplementedError(f"layer kind {self.name!r} has no side curvature to apply")


class LayerFactors(NamedTuple):
  """One layer's factors at a check step, as the transform gathers them.

  Attributes:
    a: :class:`FactorRows` of a blocked ``A``, the ``(d_A,)`` diagonal of a diagonal ``A``, or
      ``None``.
    g: :class:`FactorRows` of ``G``.
    a_traces: ``(num_blocks,)`` block traces of ``A`` (of the diagonal: its sum, ``(1,)``).
    g_traces: ``(num_blocks,)`` block traces of ``G``.
    d_a: damping added to ``A`` (scalar).
    d_g: damping added to ``G`` (scalar).
    finite: whether the layer's factor traces are finite (scalar bool).
    form_a: ``() -> rows`` of ``A`` formed again where it is called, or ``None``: the check
      step calls it inside the branch that multiplies out ``A``'s blocks due, so that XLA
      forms the rows there, only when the branch runs (rows passed into a branch are formed
      whether or not it runs: a convolution's patches, float32 copies of bfloat16 statistics).
      ``None`` under the ``vmap`` of a stack of layers.
    form_g: the same for ``G``.
  """

  a: Any
  g: Any
  a_traces: jax.Array
  g_traces: jax.Array
  d_a: jax.Array
  d_g: jax.Array
  finite: jax.Array
  form_a: Optional[Callable[[], jax.Array]] = None
  form_g: Optional[Callable[[], jax.Array]] = None


def bias_fits(shapes: Mapping[str, tuple[int, ...]], out_shape: tuple[int, ...]) -> bool:
  """Whether a module's ``bias`` leaf, if it has one, is shaped like the weight's output axes
  (a kind claims no module with a bias it would not precondition, such as a stacked layer's
  ``(L, d_out)``)."""
  return "bias" not in shapes or tuple(shapes["bias"]) == tuple(out_shape)


# The fields of Flax's layers through which a module is given its own product, promotion or
# convolution (an equalized-learning-rate Dense scaling its kernel in a custom dot_general).
OPERATION_FIELDS = ("dot_general", "dot_general_cls", "conv_general_dilated",
                    "conv_general_dilated_cls", "promote_dtype")


def replaced_operations(module: Any, base_cls: type) -> tuple[str, ...]:
  """The :data:`OPERATION_FIELDS` of ``module`` (a linen dataclass or an NNX module) set to
  other than ``base_cls``'s default: the weight it applies may then not be its parameter."""
  if dataclasses.is_dataclass(base_cls):
    defaults = {f.name: f.default for f in dataclasses.fields(base_cls)}
  else:
    defaults = {k: p.default for k, p in inspect.signature(base_cls.__init__).parameters.items()}
  plain = {"dot_general": jax.lax.dot_general,
           "conv_general_dilated": jax.lax.conv_general_dilated}
  return tuple(n for n in OPERATION_FIELDS if n in defaults and hasattr(module, n)
               and getattr(module, n) is not defaults[n]
               and getattr(module, n) is not plain.get(n))


WEIGHT_SHARING = ("auto", "expand", "reduce")


def resolve_weight_sharing(weight_sharing: str, num_terms: int, num_examples: int) -> str:
  """``'expand'`` or ``'reduce'``: ``weight_sharing`` itself, or for ``'auto'`` expand when the
  loss has more terms than the layer has examples (a term per position: language modelling,
  where expand is exact) and reduce otherwise (positions pooled before a per-example loss: a
  classifying transformer, where reduce is exact and ``T`` times cheaper)."""
  if weight_sharing != "auto":
    return weight_sharing
  return "expand" if num_terms > num_examples else "reduce"


def fold_positions(inputs: jax.Array, cotangents: jax.Array, num_terms: int, feature_axes: int,
                   weight_sharing: str) -> tuple[jax.Array, jax.Array, Optional[int]]:
  """:func:`regroup_examples` or :func:`reduce_positions`, as ``weight_sharing`` resolves for
  ``inputs`` ``(N, ...)`` (:func:`resolve_weight_sharing`), and the divisor of ``A``
  (:func:`terms_divisor`; ``None`` after a reduce, whose factors are scaled already)."""
  mode = resolve_weight_sharing(weight_sharing, num_terms, inputs.shape[0])
  if mode == "reduce" and inputs.ndim - feature_axes > 1:
    grouped = group_examples(inputs, cotangents, num_terms, feature_axes)
    # One position per example: nothing to pool, the rows are the gradient's (expand's).
    if math.prod(grouped[0].shape[1:grouped[0].ndim - feature_axes]) > 1:
      return reduce_positions(*grouped, num_terms, feature_axes) + (None,)
  inputs, cotangents = regroup_examples(inputs, cotangents, num_terms, feature_axes)
  return inputs, cotangents, terms_divisor(inputs.shape[0], num_terms)


def terms_divisor(leading: int, num_terms: int) -> Optional[int]:
  """The ``num_terms`` field of statistics whose leading axis has ``leading`` entries:
  ``None`` when they are the ``M`` loss terms, else ``M``, so that ``A = (1/M) sum a a^T``
  over all rows (K-FAC-expand) also when the rows do not regroup to ``M``: a graph network's
  node rows under a per-graph loss, a language model whose loss drops the last position
  (``M = N (T - 1)`` of ``N T`` rows), an ensemble member's ``N`` of the ``E N`` terms."""
  return None if leading == num_terms else num_terms


def a_divisor(stats: Any, leading: int) -> int:
  """What ``A`` divides its row sums by: ``stats.num_terms`` when set, else ``leading``."""
  return getattr(stats, "num_terms", None) or leading


def reduce_positions(inputs: jax.Array, cotangents: jax.Array, num_terms: int,
                     feature_axes: int) -> tuple[jax.Array, jax.Array]:
  """K-FAC-reduce: ``(inputs, cotangents)`` with the positions folded into each example.

  ``inputs`` ``(N, P..., F...)`` become their mean over the positions ``(N, F...)``, cotangents
  ``(S, N, P..., d)`` their sum ``(S, N, d)`` scaled by ``sqrt(N / M)``, so that the factors
  ``A = (1/N) sum_n a_bar a_bar^T`` and ``G = (1/N) sum_{s,n} g_hat g_hat^T`` equal the
  Gauss-Newton blocks of a deep linear network whose positions are pooled before the loss
  (``M = N``, Eschenhagen et al. 2023, section 3.2), and for a loss per position (``M = N T``)
  ``G`` divides by ``N T`` as expand's does. No positions: unchanged.
  """
  n = inputs.shape[0]
  positions = tuple(range(1, inputs.ndim - feature_axes))
  if not positions:
    return inputs, cotangents
  g_positions = tuple(range(2, cotangents.ndim - 1))
  scale = jnp.sqrt(jnp.asarray(n / num_terms, cotangents.dtype))
  return inputs.mean(positions), cotangents.sum(g_positions) * scale


def group_examples(inputs: jax.Array, cotangents: jax.Array, num_terms: int,
                   feature_axes: int) -> tuple[jax.Array, jax.Array]:
  """Before K-FAC-reduce: a leading axis of ``k M`` rows grouped into the ``M`` loss terms.

  Windows or patches folded into the batch axis (a Swin block's ``(N nW, T / nW, d)``
  windows under a per-example loss) are positions of their example: ``inputs``
  ``(k M, P..., F...)`` and cotangents ``(S, k M, P..., d)`` become ``(M, k P..., F...)`` and
  ``(S, M, k P..., d)``, the examples taken as the major part of the axis (as
  :func:`regroup_examples` takes them), so that reduce pools each example's positions, not each
  window's. Left as they are unless the leading axis is a multiple of ``M`` larger than it.
  """
  n = inputs.shape[0]
  if n <= num_terms or n % num_terms:
    return inputs, cotangents
  features = inputs.shape[inputs.ndim - feature_axes:]
  return (inputs.reshape((num_terms, -1) + features),
          cotangents.reshape((cotangents.shape[0], num_terms, -1, cotangents.shape[-1])))


def regroup_examples(inputs: jax.Array, cotangents: jax.Array, num_terms: int,
                     feature_axes: int) -> tuple[jax.Array, jax.Array]:
  """``(inputs, cotangents)`` with the example axis regrouped to ``num_terms`` loss terms.

  ``inputs`` ``(N, P..., F...)`` (``feature_axes`` trailing feature axes) and cotangents
  ``(S, N, P..., d)`` become ``(M, N P / M, F...)`` and ``(S, M, N P / M, d)``, the rows in the
  same order; factors that sum over all rows and divide by the leading count then divide by
  ``M``. Left as they are when ``M <= N`` (a per-example loss) or when ``N P`` rows do not
  split into ``M`` groups (a loss that drops the last position, a layer with fewer positions
  than the loss has terms); the kinds then record ``M`` (:func:`terms_divisor`).
  """
  n = inputs.shape[0]
  rows = math.prod(inputs.shape[:inputs.ndim - feature_axes])
  if num_terms <= n or rows % num_terms:
    return inputs, cotangents
  features = inputs.shape[inputs.ndim - feature_axes:]
  return (inputs.reshape((num_terms, rows // num_terms) + features),
          cotangents.reshape((cotangents.shape[0], num_terms, rows // num_terms,
                              cotangents.shape[-1])))
