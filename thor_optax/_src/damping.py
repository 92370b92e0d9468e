"""Damping of a layer's two Kronecker factors: ``sqrt(lambda)`` each, or split by the pi rule
(with ``pi`` clipped), never below a share of each block's mean eigenvalue.

THOR (and MindSpore's implementation) adds ``sqrt(lambda)`` to the diagonal of both ``A`` and
``G``; the pi rule of K-FAC adds ``pi sqrt(lambda)`` to ``A`` and ``sqrt(lambda) / pi`` to ``G``
with ``pi = sqrt((tr A / d_A) / (tr G / d_G))``. Either needs an inverse method that damps the
factors separately (``'factored damping'``); eigh damps ``A (x) G`` exactly instead.

The clip (``max_pi``, ``c``): ``pi`` is kept in ``[1 / c, c]``. Where a layer's two factors
differ in scale by orders of magnitude (a convolution's ``A`` of mean eigenvalue 157 against a
``G`` of 1e-7 on the MNIST CNN of ``benchmarks/``: ``pi`` = 3e4), the unclipped rule damps the
product ``A (x) G`` by ``lambda``, far above its eigenvalues, so that layer's update is its
gradient scaled by ``1 / lambda``, about 1000 times what the equal split gives it, and a KL clip
scales every layer's update down to it. Clipped, the rule still splits the damping by the
factors' scales where they differ modestly (the MNIST MLP: ``pi`` from 5 to 16). There the
equal split adds ``sqrt(0.03) = 0.17`` to a ``G`` of mean eigenvalue 4e-4 to 2e-3, so
``(G + 0.17 I)^-1`` is close to ``I / 0.17`` and only the input side is preconditioned.
Measured (benchmarks/README.md, "Which of THOR's approximations costs steps"): with ``max_pi=5``
THOR needs fewer steps on the MNIST MLP (92% test accuracy in 65 steps instead of 95, 6 seeds). With
the floor below at 0.1, one setting of a learning-rate x damping grid diverged at ``lambda =
1e-4``; with the floor at 1 both grids train in every setting, so the ``thor`` alias uses
``pi_damping=True, max_pi=5, min_relative_damping=1``. ``spngd`` takes the rule clipped at
``max_pi=5`` too (SP-NGD's unclipped rule with ``max_pi=None``); ``kfac`` and ``skfac`` split
equally; ``kaisa`` (eigh) damps exactly.

The floor (``min_relative_damping``, ``rho``): a block ``B`` of dimension ``d`` formed from
``R`` rows gets at least ``rho tr(B) / min(R, d)``, ``rho`` times the mean of the eigenvalues
its rows can make nonzero, so its damped inverse amplifies no direction by more than ``1 / rho``
times that mean's inverse, whatever ``lambda``. Factors formed from fewer
rows than dimensions (THOR's current batch) are singular, and with a small ``lambda`` a stale
inverse scales the new gradient's components outside the old rows by ``1 / sqrt(lambda)``:
this is what made THOR and SKFAC diverge at ``lambda <= 0.01`` on a learning-rate x damping
grid (benchmarks/README.md, "Robustness"). For eigh each factor's eigenvalues are floored at ``rho``
times their mean (:func:`floored_eigenvalues`) before ``lambda`` is added to their products.

References:
  Chen et al., "THOR", AAAI 2021 (split damping).
  Martens & Grosse, K-FAC, ICML 2015, section 6.3 (factored Tikhonov damping, the pi rule;
  the clip is ours).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from thor_optax._src import static_args


def split_damping(tr_a: jax.Array, dim_a: int, tr_g: jax.Array, dim_g: int,
                  sqrt_damping: jax.Array, pi_damping: bool,
                  max_pi: Any = None) -> tuple[jax.Array, jax.Array]:
  """Values added to ``A`` and ``G``: ``sqrt(lambda)`` each, or pi-scaled with ``pi`` clipped
  to ``[1 / max_pi, max_pi]``.

  Args:
    tr_a: block traces of ``A`` (any shape; summed), ``dim_a`` its dimension.
    tr_g: block traces of ``G``, ``dim_g`` its dimension.
    sqrt_damping: ``sqrt(lambda)`` (scalar).
    pi_damping: whether to apply the pi rule (``pi = 1`` where it is not finite or positive).
    max_pi: the clip ``c >= 1`` of ``pi`` (``None``: none; 1: the equal split).

  Returns:
    ``(d_A, d_G)`` scalars.
  """
  if not pi_damping:
    return sqrt_damping, sqrt_damping
  pi = jnp.sqrt((jnp.sum(tr_a) / dim_a) / (jnp.sum(tr_g) / dim_g))
  pi = jnp.where(jnp.isfinite(pi) & (pi > 0), pi, 1.0)
  if max_pi is not None:
    pi = jnp.clip(pi, 1.0 / max_pi, max_pi)
  return pi * sqrt_damping, sqrt_damping / pi


def floored(damping: jax.Array, traces: jax.Array, dims: jax.Array,
            min_relative_damping: float) -> jax.Array:
  """Per block: ``max(damping, rho * trace / dim)``.

  Args:
    damping: damping of each block (scalar or ``(n,)``).
    traces: ``(n,)`` undamped block traces.
    dims: ``(n,)`` dimensions the blocks' traces are shared among: ``min(rows, true
      (unpadded) dimension)``.
    min_relative_damping: ``rho >= 0`` (0: no floor).

  Returns:
    ``(n,)`` damping values.
  """
  share = traces / jnp.maximum(dims, 1.0)
  return jnp.maximum(damping, min_relative_damping * jnp.where(jnp.isfinite(share), share, 0.0))


def resolvable(traces: jax.Array, damping: jax.Array, dims: jax.Array) -> jax.Array:
  """Per block: whether the damped block ``B + d I`` is worth inverting in the working
  precision: ``eps`` of the dtype the blocks are factorized in, 1.2e-7 in float32 (also for
  narrower dtypes, which are factorized in float32, ``linalg.lapack_safe``), 2.2e-16 in
  float64.

  * Its statistics must not vanish next to the damping, ``tr(B) > eps d r`` (``r`` true
    dimensions): else ``B + d I`` is ``d I`` to working precision and says nothing of the
    curvature (an all-zero batch, units that did not fire, statistics whose trace collapsed
    to roundoff).
  * It must not be near-singular, ``tr(B) eps <= d``: its eigenvalues lie in ``[d, tr(B) + d]``,
    so its condition number is at most ``1 + tr(B) / d``; above ``1 / eps`` the computed
    inverse may have no correct digit. With the floor (``rho > 0``) the bound is at most
    ``1 + min(R, d) / rho`` (1281 for 128-blocks and ``rho = 0.1``), so this rejects blocks only
    when the floor is off (``scale_by_thor``'s default) and ``lambda`` is tiny (``1e-12``).

  A block that fails keeps the inverse it has, like one whose inverse is not finite.

  Args:
    traces: ``(n,)`` undamped block traces.
    damping: ``(n,)`` damping of each block (after the floor).
    dims: ``(n,)`` true (unpadded) dimensions of each block.

  Returns:
    ``(n,)`` bool.
  """
  eps = jnp.finfo(jnp.promote_types(jnp.result_type(traces), jnp.float32)).eps
  return (traces > eps * damping * dims) & (traces * eps <= damping)


# A block whose damped trace falls below this share of its reference at a check has collapsed.
COLLAPSE_RATIO = 0.1
# At each check that finds a block collapsed, its reference is multiplied by this, so that
# statistics that stay low are taken after a few checks.
COLLAPSE_DECAY = 0.5


def collapsed(traces: jax.Array, trace_ref: jax.Array, damping: jax.Array,
              damping_ref: jax.Array) -> jax.Array:
  """Per block: whether its statistics collapsed since its last refresh, so that they would
  grow its inverse more than ``1 / COLLAPSE_RATIO`` (10) times at once.

  A batch that the model fits almost exactly (a loss of 1e-5, reached on a memorized training
  set) has cotangents, and so ``G`` blocks, that vanish next to those of the batches around it;
  their inverses, nearly ``1 / d``, then scale the next steps' gradients far beyond what those
  batches' curvature allows. On the CNN of ``benchmarks/robustness.py`` at learning rate 0.03
  and damping 1e-4, the damped traces of the ``G`` blocks of both convolutions fell to 0.7%
  and 0.4% of those at their last refresh at a check whose batch had a loss of 0.0000; the
  training loss went to 69 on the next step and stayed above the first step's 2.30: the run
  diverged. With the ratio at 1% (before) the same grid on seed 3 of init and batch order
  diverged at a check whose batch had a loss of 7.5e-5 (last-10 loss 39.6); at 10% it ends at
  1.2, and the steps of ``benchmarks/ablation.py``'s ``thor`` row are those at 1% on 6 seeds
  of both MNIST models (benchmarks/README.md, "Robustness").

  A rejection multiplies the block's reference by ``COLLAPSE_DECAY`` (0.5; done by the check
  step, ``check_step.without_collapsed``): statistics that fall and stay low, as a ``G`` may
  when the loss falls tenfold between two checks far apart, are taken after a few checks
  instead of leaving a stale inverse for the rest of the run.

  The damped traces are compared (what the inverses scale by), and the reference is lowered in
  proportion when ``lambda`` was lowered since (a damping schedule), so that annealing the
  damping never counts as a collapse; the damping each block gets from ``lambda`` (its share
  by the pi rule, its floor) follows the statistics and is judged with them.

  A collapsed block keeps the inverse it has, like one whose statistics are not finite, and
  its reference, so it is refreshed again once its statistics come back within the ratio.

  Args:
    traces: ``(n,)`` damped traces now (0 where the statistics were rejected already).
    trace_ref: ``(n,)`` damped traces at each block's last refresh (0: never refreshed).
    damping: scalar ``lambda`` now.
    damping_ref: ``(n,)`` ``lambda`` at each block's last refresh.

  Returns:
    ``(n,)`` bool, ``False`` for blocks never refreshed.
  """
  scale = jnp.minimum(1.0, damping / jnp.where(damping_ref > 0, damping_ref, damping))
  return (trace_ref > 0) & (traces < COLLAPSE_RATIO * scale * trace_ref)


def floored_eigenvalues(eigenvalues: jax.Array, min_relative_damping: Any,
                        num_real: Optional[int] = None) -> jax.Array:
  """A factor's eigenvalues, each at least ``rho`` times their mean: the floor for eigh, whose
  damping ``lambda`` acts on the products ``eig_A eig_G`` (KAISA's exact damping). Flooring each
  factor bounds every direction, also those where one factor's eigenvalue is large and the
  other's is 0, which a floor on ``lambda`` alone would not.

  Args:
    eigenvalues: eigenvalues of a factor's blocks (any shape).
    min_relative_damping: ``rho >= 0``.
    num_real: how many of them are the factor's own, ``d``; the others are a padded block's
      padding, whose eigenvalues the eigh refresh stores as 0, left out of the mean so that the
      floor does not depend on the block size. ``None``: all.
  """
  count = eigenvalues.size if num_real is None else min(num_real, eigenvalues.size)
  floor = min_relative_damping * jnp.sum(eigenvalues) / count
  return jnp.maximum(eigenvalues, jnp.where(jnp.isfinite(floor), floor, 0.0))


class FactoredDamping:
  """The damping piece of a transform: ``pi_damping`` needs factor-wise damping; ``max_pi`` is
  its clip, ``min_relative_damping`` the floor ``rho`` of the module docstring.

  Raises:
    TypeError: if ``pi_damping`` is not a bool (a string such as ``'False'`` is truthy), or
      ``max_pi`` or ``min_relative_damping`` is not a number (``max_pi``: or ``None``).
    ValueError: if ``min_relative_damping`` is a number (Python, numpy, 0-d array) that is
      negative or not finite, or ``max_pi`` one below 1 or not finite.
  """

  provides: frozenset[str] = frozenset()

  def __init__(self, pi_damping: bool, min_relative_damping: float = 0.0,
               max_pi: Any = None, where: str = "scale_by_thor"):
    if not isinstance(pi_damping, (bool, np.bool_)):
      raise TypeError(f"thor_optax.{where}: pi_damping must be True or False, got "
                      f"{type(pi_damping).__name__} {pi_damping!r}.")
    self.pi_damping = bool(pi_damping)
    static_args.check_number(where, "max_pi", max_pi, lambda v: 1.0 <= v < math.inf,
                             "finite and >= 1", optional=True,
                             advice="None: no clip of pi; 1: the equal split.")
    self.max_pi = max_pi
    static_args.check_number(where, "min_relative_damping", min_relative_damping,
                             lambda v: 0.0 <= v < math.inf, "finite and >= 0",
                             advice="0: no floor.")
    # A Python float, or a scalar array under optax.inject_hyperparams.
    self.min_relative_damping = min_relative_damping
    self.requires = frozenset({"factored damping"} if self.pi_damping else ())

  def describe(self) -> str:
    return f"pi_damping={self.pi_damping}"
