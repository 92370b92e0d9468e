"""Batched linear algebra on stacks of factor blocks ``(K, b, b)``: the factorizations every
inverse method is built from.

* :func:`cholesky_inverse` of damped blocks (THOR, K-FAC);
* :func:`eigh_factors`: eigendecompositions of undamped blocks (KAISA);
* :func:`woodbury_inverse` / :func:`woodbury_core_inverse` from the ``m`` rows behind a block
  when ``m < b``: an ``m x m`` Cholesky instead of a ``b x b`` one (SKFAC);
* :func:`on_shards`: a stack's factorizations split over the devices of a mesh (KAISA).

On CPU, LAPACK runs one matrix at a time (:func:`lapack_safe`, a deadlock of batched calls);
narrow dtypes are factorized in float32.

References:
  Chen et al., THOR, AAAI 2021 (MindSpore ``thor.py``: ``CholeskyTrsm``, then ``L^-T L^-1``).
  Pauloski et al., "KAISA", SC 2021, and SC 2020, section 3 (eigendecomposition).
  Tang et al., "SKFAC", CVPR 2021, section 3 (Sherman-Morrison-Woodbury).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.extend.backend
import jax.numpy as jnp
import numpy as np

from thor_optax._src import explicit


def damp(blocks: jax.Array, damping: jax.Array, real: jax.Array) -> jax.Array:
  """Adds ``damping`` to the true diagonal and 1 to the padded diagonal of each block.

  Args:
    blocks: ``(K, b, b)`` symmetric PSD blocks (zero on padded rows/columns).
    damping: ``(K,)`` per-block damping (the value added to the factor's diagonal).
    real: ``(K, b)``, 1 on true dimensions and 0 on identity padding.

  Returns:
    ``(K, b, b)`` blocks ``F_k + diag(damping_k * real_k + (1 - real_k))``, whose inverse is the
    damped inverse on the true dimensions and the identity on the padding.
  """
  diag = damping[:, None] * real + (1.0 - real)
  return blocks + diag[:, :, None] * jnp.eye(blocks.shape[-1], dtype=blocks.dtype)


def platform_dependent(*args: Any, cpu: Callable[..., Any], default: Callable[..., Any]) -> Any:
  """``cpu(*args)`` on CPU, ``default(*args)`` on every other platform, chosen when the step is
  lowered.

  ``jax.lax.platform_dependent`` traces every branch and keeps the lowering platform's. In a
  process whose only backend is the CPU (``jax.extend.backend.backends()``), every computation
  lowers for the CPU, so only ``cpu`` is traced: tracing ``default`` too took the MNIST
  models' check steps (``benchmarks/mnist.py``) 0.12-0.15 s more to lower (medians of 8
  lowerings, interleaved: MLP 0.449 s against 0.294, CNN 0.541 against 0.418). Elsewhere this
  is ``jax.lax.platform_dependent`` itself.

  Args:
    *args: the operands, passed to the branch.
    cpu, default: the branches, functions of ``args`` with the same output structure.

  Returns:
    the chosen branch's output.
  """
  if set(jax.extend.backend.backends()) == {"cpu"}:
    return cpu(*args)
  return jax.lax.platform_dependent(*args, cpu=cpu, default=default)


def lapack_safe(fn: Callable[[jax.Array], Any], stack: jax.Array) -> Any:
  """``fn`` over a stack ``(K, b, b)``: batched, but one matrix at a time on CPU.

  jaxlib's CPU LAPACK kernels (``potrf``, ``trsm``, ``syevd``; jax 0.10) split a batch into
  tasks on XLA's intra-op thread pool and block until they finish. When as many batched calls
  run at once as the pool has threads (independent block groups of one step, or one per device
  of a multi-device CPU mesh), every pool thread waits for tasks that no thread is free to run,
  and the program hangs. A batch of one is run inline, so on CPU ``fn`` is mapped over the
  stack (``lax.map``); other platforms get the batched call. The choice is made per platform
  when the function is lowered (:func:`platform_dependent`).

  LAPACK and cuSOLVER factorize float32 and float64 only: a narrower stack (a state kept in
  ``dtype=jnp.bfloat16`` or ``float16``) is factorized in float32 and the results are cast
  back to its dtype.
  """
  if jnp.issubdtype(stack.dtype, jnp.floating) and jnp.finfo(stack.dtype).bits < 32:
    out = lapack_safe(fn, stack.astype(jnp.float32))
    return jax.tree.map(lambda y: y.astype(stack.dtype), out)

  def one_at_a_time(x):
    return jax.tree.map(lambda y: y[:, 0], jax.lax.map(lambda m: fn(m[None]), x))

  return platform_dependent(stack, cpu=one_at_a_time, default=fn)


def _batched_cholesky_inverse(matrices: jax.Array) -> jax.Array:
  """``L^-1`` of the Cholesky factors ``L`` of SPD ``matrices (K, b, b)``.

  The factorization reads the lower triangle only (``symmetrize_input=False``: the blocks are
  symmetric up to rounding, and ``(M + M^T) / 2`` costs a transposing copy per block), and
  ``L^-1`` solves ``X L = I`` from the right: on CPU (OpenBLAS ``strsm``, 128-blocks) that
  solve took 61 us a block against 109 us for ``L X = I`` from the left.
  """
  chol = jax.lax.linalg.cholesky(matrices, symmetrize_input=False)
  eye = jnp.broadcast_to(jnp.eye(matrices.shape[-1], dtype=matrices.dtype), matrices.shape)
  return jax.lax.linalg.triangular_solve(chol, eye, left_side=False, lower=True)


def cholesky_inverse(matrices: jax.Array) -> jax.Array:
  """Inverses of a stack of symmetric positive-definite matrices by Cholesky.

  Args:
    matrices: ``(K, b, b)`` SPD.

  Returns:
    ``(K, b, b)`` symmetric inverses ``L^-T L^-1``; non-finite where a factorization failed
    (callers keep the previous inverse there).
  """
  return _inverse_from_factor_inverse(lapack_safe(_batched_cholesky_inverse, matrices))


def _inverse_from_factor_inverse(chol_inv: jax.Array) -> jax.Array:
  """``L^-T L^-1`` of ``L^-1`` (``(K, b, b)``), symmetrized against rounding."""
  inv = jnp.einsum("kji,kjl->kil", chol_inv, chol_inv)
  return 0.5 * (inv + jnp.swapaxes(inv, -1, -2))


def is_finite_block(x: jax.Array) -> jax.Array:
  """``(K,)`` bool: every entry of block ``k`` of ``x (K, ...)`` is finite, and their sum does
  not overflow.

  Judged by the sum of each block in float32 or wider (NaN or infinite when an entry is; it
  also rejects blocks whose entries come within a factor of the block's size of float32's
  largest value, 3e38): one floating-point reduction, where ``all(isfinite)`` was an
  elementwise kernel and, on XLA:CPU, three for the boolean reduction of a 128-block."""
  dtype = jnp.promote_types(x.dtype, jnp.float32)
  return jnp.isfinite(jnp.sum(x.reshape(x.shape[0], -1), axis=1, dtype=dtype))


def eigh_factors(blocks: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Eigendecomposition of a stack of symmetric PSD factor blocks, eigenvalues clamped at 0.

  Args:
    blocks: ``(K, b, b)`` undamped factor blocks (zero on padded rows/columns).

  Returns:
    ``(values, vectors)``: ``(K, b)`` eigenvalues ``>= 0`` and ``(K, b, b)`` orthonormal
    eigenvectors (columns), ``blocks[k] = vectors[k] @ diag(values[k]) @ vectors[k].T``.
  """
  sym = 0.5 * (blocks + jnp.swapaxes(blocks, -1, -2))
  values, vectors = lapack_safe(jnp.linalg.eigh, sym)
  return jnp.maximum(values, 0.0), vectors


def woodbury_core_inverse(u: jax.Array, damping: jax.Array) -> jax.Array:
  """The ``m x m`` cores ``C = (U^T U + d I_m)^-1`` of the Woodbury identity, batched.

  With them ``(U U^T + d I_b)^-1 = (I_b - U C U^T) / d``, which can be applied to a vector in
  ``O(b m)`` without forming the ``b x b`` inverse (``blocks.left_multiply_low_rank``).

  Args:
    u: ``(K, b, m)``, the factor block is ``U U^T``.
    damping: ``(K,)`` values ``d > 0`` added to the factor blocks' diagonals.

  Returns:
    ``(K, m, m)`` symmetric core inverses; non-finite where the Cholesky factorization failed.
  """
  m = u.shape[-1]
  core = jnp.einsum("kbi,kbj->kij", u, u) + damping[:, None, None] * jnp.eye(m, dtype=u.dtype)
  return cholesky_inverse(core)


def woodbury_inverse(u: jax.Array, damping: jax.Array, real: jax.Array) -> jax.Array:
  """Damped inverses ``(U U^T + d I)^-1`` of low-rank blocks by Sherman-Morrison-Woodbury.

  ``(U U^T + d I_b)^-1 = (I_b - U (U^T U + d I_m)^-1 U^T) / d``: one batched ``m x m``
  Cholesky instead of a ``b x b`` one, ``O(b m^2 + b^2 m + m^3)`` per block; cheaper than
  :func:`cholesky_inverse` when ``m < b``.

  Args:
    u: ``(K, b, m)``, the factor block is ``U U^T`` (for ``F = scale * X^T X`` with rows
      ``X (m, b)``, ``U = sqrt(scale) X^T``); padded rows of ``U`` are zero.
    damping: ``(K,)`` value added to each block's true diagonal (``> 0``).
    real: ``(K, b)``, 1 on true dimensions, 0 on identity padding.

  Returns:
    ``(K, b, b)`` the same inverse as ``cholesky_inverse(damp(U U^T, damping, real))``:
    the damped inverse on true dimensions, the identity on padding; non-finite where the
    factorization failed.
  """
  d = damping[:, None, None]
  core_inv = woodbury_core_inverse(u, damping)
  inv = (jnp.eye(u.shape[1], dtype=u.dtype) - jnp.einsum("kbi,kij,kcj->kbc", u, core_inv, u)) / d
  mask = real[:, :, None] * real[:, None, :]
  return inv * mask + (1.0 - real)[:, :, None] * jnp.eye(u.shape[1], dtype=u.dtype)


def on_shards(fn: Callable[..., Any], sharding: Optional[jax.sharding.NamedSharding],
               *stacks: jax.Array) -> Any:
  """``fn(*stacks)`` for stacks of blocks ``(K, ...)``, each device computing its share.

  With ``sharding`` (a ``NamedSharding`` whose spec names the mesh axes of the block axis),
  the stacks are padded to a multiple of the number of devices along those axes (with copies
  of their first block; the padding's results are dropped) and ``fn`` runs under
  ``jax.shard_map`` on ``ceil(K / D)`` blocks per device (KAISA's layer-wise distribution of
  the inversion work; THOR's uniform blocks make the shares even). The results are gathered
  where the optimizer state's sharding puts them. ``None`` runs ``fn`` as is.

  Under an explicit-sharding mesh the stacks are resharded to ``sharding`` before the
  ``shard_map`` and the results are returned replicated (the layout the stacks came in).
  """
  if sharding is None:
    return fn(*stacks)
  spec = jax.sharding.PartitionSpec(sharding.spec[0] if sharding.spec else None)
  axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
  devices = int(np.prod([sharding.mesh.shape[a] for a in axes if a is not None]))
  k = stacks[0].shape[0]
  pad = -k % devices
  padded = [jnp.concatenate([x, jnp.repeat(x[:1], pad, axis=0)]) if pad else x for x in stacks]
  typed = explicit.explicit_mesh(stacks[0]) is not None
  if typed:  # explicit shardings: the stacks' types must say what in_specs says
    padded = [jax.sharding.reshard(x, jax.sharding.NamedSharding(sharding.mesh, spec))
              for x in padded]
  out = jax.shard_map(fn, mesh=sharding.mesh, in_specs=spec, out_specs=spec)(*padded)
  if typed:  # gathered, as the stacks came in
    out = jax.tree.map(explicit.replicate, out)
  return jax.tree.map(lambda y: y[:k], out)
