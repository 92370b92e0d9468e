"""Arrays typed with explicit shardings (``jax.sharding.AxisType.Explicit`` mesh axes).

Under an explicit-sharding mesh (``jax.make_mesh(..., axis_types=(AxisType.Explicit, ...))``
with ``jax.set_mesh``, as the Flax NNX tutorials set it up) every array's type carries its
sharding, and JAX rejects at trace time what would leave the result's sharding ambiguous:
concatenating arrays of different shardings, or contracting an axis that is sharded (the
batch axis of the curvature statistics under data parallelism) without saying how the result
is laid out. The package's internal computations are written for these rules with three
helpers, which do nothing for arrays without an explicit sharding (no mesh, or ``Auto`` axes,
where the compiler chooses the layouts):

* :func:`contraction_sharding`: the ``out_sharding`` of a contraction over a sharded axis
  (a covariance over the examples): replicated, so the compiler reduces the partial sums across
  the devices, as it does in ``Auto`` mode;
* :func:`replicate`: an array with no axis sharded (a gradient matrix before the block-diagonal
  products, or the rows behind a factor that is inverted from its rows);
* :func:`reshard_like`: an array laid out as another (a preconditioned gradient leaf as the
  gradient leaf it replaces);
* :func:`align_examples`: a layer's statistics with the examples axis of every field sharded
  alike and no other axis sharded, whatever layouts the capture produced.

References:
  JAX, "Explicit sharding (a.k.a. 'sharding in types')",
  https://docs.jax.dev/en/latest/notebooks/explicit-sharding.html.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec


def explicit_mesh(x: Any) -> Optional[Any]:
  """The mesh of ``x``'s type if it has an explicit axis, else ``None``.

  Args:
    x: an array or tracer (any shape).

  Returns:
    the ``jax.sharding.AbstractMesh`` of ``x``'s sharding (``jax.typeof(x).sharding.mesh``) when
    one of its axes is ``AxisType.Explicit``; ``None`` for an unsharded array, a
    ``SingleDeviceSharding``, or a mesh whose axes are all ``Auto``/``Manual``.
  """
  sharding = getattr(jax.typeof(x), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or getattr(mesh, "empty", True):
    return None
  if not any(t == AxisType.Explicit for t in mesh.axis_types):
    return None
  return mesh


def _is_sharded(x: Any) -> bool:
  spec = getattr(jax.typeof(x).sharding, "spec", ())
  return any(axis is not None for axis in spec)


def contraction_sharding(*xs: Any) -> Optional[NamedSharding]:
  """The ``out_sharding`` of a contraction of ``xs`` whose result is to be replicated.

  Args:
    xs: the operands (arrays or tracers).

  Returns:
    ``NamedSharding(mesh, PartitionSpec())`` on the first explicit mesh among the operands'
    types, or ``None`` (let JAX decide) when no operand has an explicit sharding.
  """
  for x in xs:
    mesh = explicit_mesh(x)
    if mesh is not None:
      return NamedSharding(mesh, PartitionSpec())
  return None


def replicate(x: jax.Array) -> jax.Array:
  """``x`` with no axis sharded (an all-gather) if its type has an explicit sharding that
  shards an axis; otherwise ``x`` itself. Shape and values are unchanged."""
  mesh = explicit_mesh(x)
  if mesh is None or not _is_sharded(x):
    return x
  return jax.sharding.reshard(x, NamedSharding(mesh, PartitionSpec()))


def reshard_like(x: jax.Array, ref: Any) -> jax.Array:
  """``x`` laid out as ``ref`` (same shape) when ``ref``'s type has an explicit sharding that
  differs from ``x``'s; otherwise ``x`` itself."""
  mesh = explicit_mesh(ref)
  if mesh is None:
    return x
  want = jax.typeof(ref).sharding
  if getattr(jax.typeof(x), "sharding", None) == want:
    return x
  return jax.sharding.reshard(x, want)


def align_examples(stats: Any, example_axes: Mapping[str, int]) -> Any:
  """A layer's statistics laid out for the check step under an explicit-sharding mesh.

  The capture may hand over fields sharded differently (the recorded inputs sharded over the
  batch, the output cotangents replicated, or features sharded over a model axis). Every field
  in ``example_axes`` is resharded so that its example axis is sharded as the first field whose
  example axis is sharded (the data-parallel axis, so the covariances are partial sums reduced
  across devices) and no other axis is: selecting a device's examples of a replicated field is
  local, gathering sharded features is an all-gather.

  Args:
    stats: a layer kind's statistics (a dataclass whose ``example_axes`` fields are arrays or
      ``None``: ``DenseStats`` inputs ``(N, ..., d_in)`` and cotangents ``(S, N, ..., d_out)``,
      ...).
    example_axes: the kind's ``{field: example axis}``.

  Returns:
    ``stats`` with the fields resharded (same shapes and values); ``stats`` itself when no
    field has an explicit sharding or ``stats`` is not a dataclass.
  """
  if not dataclasses.is_dataclass(stats):
    return stats
  fields = {name: getattr(stats, name) for name in example_axes
            if getattr(stats, name) is not None}  # optional fields (a tied embedding's)
  example_axes = {name: axis for name, axis in example_axes.items() if name in fields}
  mesh = next((m for m in map(explicit_mesh, fields.values()) if m is not None), None)
  if mesh is None:
    return stats
  examples = None
  for name, axis in example_axes.items():
    spec = tuple(jax.typeof(fields[name]).sharding.spec)
    if axis < len(spec) and spec[axis] is not None:
      examples = spec[axis]
      break
  new = {}
  for name, axis in example_axes.items():
    x = fields[name]
    want = NamedSharding(mesh, PartitionSpec(*(examples if i == axis else None
                                               for i in range(x.ndim))))
    if explicit_mesh(x) is None or jax.typeof(x).sharding != want:
      new[name] = jax.sharding.reshard(x, want)
  return dataclasses.replace(stats, **new) if new else stats


def flatten_rows(x: jax.Array) -> jax.Array:
  """``x (..., d)`` as rows ``(R, d)``, ``R`` the product of the leading axes.

  Under an explicit-sharding mesh a reshape that merges a sharded axis into a minor position
  (the examples axis ``N`` of cotangents ``(S, N, ..., d)``) is rejected; the sharded leading
  axis is then moved to the front first. The rows are then in another order, which no factor
  depends on (``F = scale * rows^T rows``).

  Args:
    x: array of rank ``>= 1``.

  Returns:
    ``(prod(x.shape[:-1]), x.shape[-1])``.
  """
  if explicit_mesh(x) is not None:
    spec = tuple(jax.typeof(x).sharding.spec)[:x.ndim - 1]
    sharded = [i for i, axis in enumerate(spec) if axis is not None]
    if sharded and sharded[0] != 0:
      x = jax.numpy.moveaxis(x, sharded[0], 0)
  return x.reshape(-1, x.shape[-1])
