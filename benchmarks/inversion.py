"""Inversion time versus layer width: whole factors against THOR's 128-blocks, three methods.

For each width ``d`` (``--widths``), a random PSD Kronecker factor ``F = X^T X / m`` is built from
``m`` rows ``X (m, d)`` (``--rows``, default 128: a batch of 128 examples on a dense layer;
entries i.i.d. standard normal, float32, seed ``--seed``). It is laid out in two ways:

* **unsplit**: one ``d x d`` block, ``blocks.split_shape(d, None)``, a ``(1, d, d)`` stack;
* **split**: THOR's hardware-driven split, ``blocks.split_shape(d, 128)``: ``K = ceil(d / 128)``
  diagonal blocks of 128 (a factor narrower than 128 is one block of the next power of two), a
  ``(K, b, b)`` stack built with ``blocks.block_covariances``; the columns are zero-padded to
  ``b K`` and the padding gets the identity through the ``real`` mask of ``linalg.damp`` /
  ``linalg.woodbury_inverse``, as in the package (no padding for multiples of 128).

and each stack is handed to one of the package's batched inverses:

* ``cholesky``: ``linalg.cholesky_inverse(linalg.damp(F_blocks, damping, real))``;
* ``eigh``: ``linalg.eigh_factors(F_blocks)`` (undamped; the damping is applied later, when a
  gradient is preconditioned, so it is not part of this cost);
* ``woodbury``: ``linalg.woodbury_inverse(U_blocks, damping, real)`` from the rows,
  ``U = sqrt(1/m) X^T`` blocked like ``F`` (``(K, b, m)``); it includes forming the ``m x m``
  core ``U^T U``, while the other two start from the given ``F`` blocks. It is cheaper only when
  ``m < b``; it is timed in every case, and cells where ``m >= b`` are marked with ``*``.

The damping added to the factor's diagonal is ``sqrt(0.03)``: THOR splits ``lambda = 0.03``
as ``sqrt(lambda)`` per factor (``damping.split_damping`` without the pi rule).

Timing: each function is ``jax.jit``-ed with the stacks as arguments; ``--warmup`` untimed calls
(the first compiles; compilation is not reported), then the median wall time of up to
``--repeats`` calls, each waited on with ``jax.block_until_ready``, stopping early (after at least
3 calls) once a case has used ``--budget`` seconds. On a shared, loaded machine ``--stat min``
reports the fastest call instead (contention only adds time). Unsplit ``eigh`` above
``--max-unsplit-eigh`` and any unsplit method above ``--max-unsplit`` is skipped (``-``).

Correctness, once per width and layout, from the warm-up outputs: the maximum relative
difference ``max|W - C| / max|C|`` between the Woodbury (``W``) and the Cholesky (``C``)
inverses, and the relative reconstruction error ``max|V diag(w) V^T - F| / max|F|`` of ``eigh``.
Values above ``--tol`` are flagged with ``!``: a broken method shows there, not only as a time.

Two tables: milliseconds per (method, layout), and the speed-up of split over unsplit
(``unsplit ms / split ms``) per method. Defaults: widths 256 512 1024 2048 4096, 20 repeats;
``--quick`` (smoke run): widths 256 512 1024, 3 repeats.

A third table, ``--forms`` (instead of the two above), answers what the one-block-at-a-time
CPU path (``linalg.lapack_safe``) costs against two batched forms, for stacks of ``K`` (``--forms-
blocks``) 128-blocks ``F = X^T X / 128`` damped by their mean eigenvalue times ``floor`` (1:
``thor``'s ``min_relative_damping``; 0.1: the other aliases'):

* ``loop``: ``linalg.cholesky_inverse`` as the package runs it (on CPU, LAPACK one block at a
  time);
* ``batched LAPACK``: the same Cholesky inverse in one batched call, which the package avoids
  on CPU (concurrent batched calls deadlock XLA's CPU thread pool, ``linalg.lapack_safe``):
  timed alone, nothing else running;
* ``Newton-Schulz``: a matmul-only inverse, ``X_0 = I / tr(F)``, ``X <- 2 X - X F X``
  (``--forms-iterations``), batched GEMMs with no LAPACK call; its relative difference to the
  Cholesky inverse is printed with its time (quadratic convergence from a start whose error
  is ``1 - lambda / tr``: the iterations needed grow with ``log(tr / lambda_min)``).

Run::

    python3 benchmarks/inversion.py --quick
    python3 benchmarks/inversion.py --forms
    python3 benchmarks/inversion.py
    python3 benchmarks/inversion.py --widths 1024 4096 --rows 64 --repeats 20
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

# The repository's thor_optax, not an installed (possibly older) copy.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from thor_optax._src import blocks  # noqa: E402
from thor_optax._src import linalg  # noqa: E402

DAMPING = 0.03
BLOCK = 128
METHODS = ("cholesky", "eigh", "woodbury")
LAYOUTS = ("unsplit", "split")
WIDTHS = (256, 512, 1024, 2048, 4096)
QUICK_WIDTHS = (256, 512, 1024)


def timed(fn, args, opts) -> tuple[float, object]:
  """``(ms, output of the first call)`` of ``fn(*args)``, compilation excluded.

  ``opts.warmup`` untimed calls (the first compiles), then up to ``opts.repeats`` timed calls,
  stopping after at least 3 of them once ``opts.budget`` seconds have been spent on them;
  returns their median (or minimum, ``opts.stat == 'min'``).
  """
  out = jax.block_until_ready(fn(*args))
  for _ in range(opts.warmup - 1):
    jax.block_until_ready(fn(*args))
  repeats, budget = opts.repeats, opts.budget
  times = []
  start = time.perf_counter()
  for i in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
    if i + 1 >= 3 and time.perf_counter() - start > budget:
      break
  return 1e3 * float(np.min(times) if opts.stat == "min" else np.median(times)), out


_CHOLESKY = jax.jit(lambda f, dmp, real: linalg.cholesky_inverse(linalg.damp(f, dmp, real)))
_EIGH = jax.jit(linalg.eigh_factors)
_WOODBURY = jax.jit(linalg.woodbury_inverse)
_RECONSTRUCT = jax.jit(lambda values, vectors: jnp.einsum("kij,kj,klj->kil", vectors, values,
                                                          vectors))


def max_rel_diff(a, ref) -> float:
  """``max|a - ref| / max|ref|`` in float64 (``inf`` if ``a`` is not finite)."""
  a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
  if not np.all(np.isfinite(a)):
    return math.inf
  return float(np.max(np.abs(a - ref)) / np.max(np.abs(ref)))


def stacks(x: jax.Array, block_size: int | None):
  """``(F_blocks, U_blocks, real, damping)`` of ``F = X^T X / m`` laid out with ``block_size``."""
  m, d = x.shape
  b, n = blocks.split_shape(d, block_size)
  slot = blocks.FactorSlot(dim=d, block=b, start=0, num_blocks=n)
  f = blocks.block_covariances(x, 1.0 / m, slot, jnp.arange(n))              # (K, b, b)
  u = math.sqrt(1.0 / m) * jnp.transpose(blocks.blocked_rows(x, slot), (1, 2, 0))  # (K, b, m)
  real = np.zeros(slot.padded_dim, np.float32)
  real[:d] = 1.0
  real = jnp.asarray(real.reshape(n, b))
  damping = jnp.full((n,), math.sqrt(DAMPING), jnp.float32)
  return jax.block_until_ready((f, u, real, damping))


def measure(d: int, args) -> dict:
  """Times and checks of one width: ``{(method, layout): ms or None}`` plus the checks."""
  rng = np.random.default_rng(args.seed)
  x = jnp.asarray(rng.standard_normal((args.rows, d)), jnp.float32)
  result = {"ms": {}, "woodbury_err": {}, "eigh_err": {}, "block": {}}
  for layout in LAYOUTS:
    block_size = BLOCK if layout == "split" else None
    f, u, real, damping = stacks(x, block_size)
    result["block"][layout] = f.shape[-1]
    unsplit = layout == "unsplit"
    too_big = unsplit and args.max_unsplit is not None and d > args.max_unsplit
    ms_chol, inv_chol = (None, None) if too_big else timed(
        _CHOLESKY, (f, damping, real), args)
    ms_wood, inv_wood = (None, None) if too_big else timed(
        _WOODBURY, (u, damping, real), args)
    skip_eigh = too_big or (unsplit and d > args.max_unsplit_eigh)
    ms_eigh, eig = (None, None) if skip_eigh else timed(_EIGH, (f,), args)
    result["ms"].update({("cholesky", layout): ms_chol, ("eigh", layout): ms_eigh,
                         ("woodbury", layout): ms_wood})
    if inv_chol is not None:
      result["woodbury_err"][layout] = max_rel_diff(inv_wood, inv_chol)
    if eig is not None:
      result["eigh_err"][layout] = max_rel_diff(_RECONSTRUCT(*eig), f)
    del f, u, inv_chol, inv_wood, eig
  return result


def markdown(headers: list[str], rows: list[list[str]]) -> str:
  """A markdown table, columns padded to a common width (first column left-aligned)."""
  widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]

  def line(cells):
    cells = [str(c).ljust(w) if i == 0 else str(c).rjust(w)
             for i, (c, w) in enumerate(zip(cells, widths))]
    return "| " + " | ".join(cells) + " |"

  rule = "|" + "|".join(("-" * (w + 1) + ("-" if i == 0 else ":")) for i, w in enumerate(widths))
  return "\n".join([line(headers), rule + "|"] + [line(r) for r in rows])


def fmt_ms(ms: float | None, mark: bool = False) -> str:
  """Milliseconds to 3 significant-ish digits, ``-`` if skipped, ``*`` appended if ``mark``."""
  if ms is None:
    return "-"
  text = f"{ms:.3f}" if ms < 1 else f"{ms:.2f}" if ms < 100 else f"{ms:.0f}"
  return text + ("*" if mark else "")


def fmt_err(errs: dict, tol: float) -> str:
  """``unsplit / split`` relative errors, ``-`` where not computed, ``!`` above ``tol``."""
  cells = []
  for layout in LAYOUTS:
    err = errs.get(layout)
    cells.append("-" if err is None else f"{err:.1e}" + ("!" if not err <= tol else ""))
  return " / ".join(cells)


def newton_schulz_inverse(matrices: jax.Array, iterations: int) -> jax.Array:
  """``(K, b, b)`` inverses of SPD ``matrices`` by ``iterations`` Newton-Schulz steps
  ``X <- 2 X - X F X`` from ``X_0 = I / tr(F)`` (``tr(F) >= lambda_max``: converges)."""
  trace = jnp.trace(matrices, axis1=1, axis2=2)
  x = jnp.eye(matrices.shape[-1], dtype=matrices.dtype)[None] / trace[:, None, None]
  for _ in range(iterations):
    x = 2 * x - x @ matrices @ x
  return x


def _batched_lapack_inverse(matrices: jax.Array) -> jax.Array:
  """``linalg.cholesky_inverse`` with its factorization in one batched call on every platform."""
  # pylint: disable=protected-access
  return linalg._inverse_from_factor_inverse(linalg._batched_cholesky_inverse(matrices))


def forms_table(args) -> None:
  """Table 3 (``--forms``): the CPU loop against batched LAPACK and Newton-Schulz."""
  rows = []
  for k in args.forms_blocks:
    x = jax.random.normal(jax.random.PRNGKey(args.seed), (k, BLOCK, BLOCK))
    f = jnp.einsum("kri,krj->kij", x, x) / BLOCK
    mean = jnp.trace(f, axis1=1, axis2=2) / BLOCK
    for floor in (1.0, 0.1):
      m = jax.block_until_ready(f + (floor * mean)[:, None, None] * jnp.eye(BLOCK))
      loop_ms, ref = timed(jax.jit(linalg.cholesky_inverse), (m,), args)
      batched_ms, _ = timed(jax.jit(_batched_lapack_inverse), (m,), args)
      cells = [str(k), f"{floor:g}", f"{loop_ms:.2f}", f"{batched_ms:.2f}"]
      for it in args.forms_iterations:
        ms, out = timed(jax.jit(lambda a, it=it: newton_schulz_inverse(a, it)), (m,), args)
        cells.append(f"{ms:.2f} ({max_rel_diff(out, ref):.0e})")
      rows.append(cells)
  print("\n3. One 128-block stack inverted: the CPU loop, batched LAPACK, Newton-Schulz "
        "(ms; in brackets the max relative difference to the loop's inverse)\n")
  print(markdown(["K", "floor", "loop", "batched LAPACK"]
                 + [f"Newton-Schulz {it}" for it in args.forms_iterations], rows))


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--widths", type=int, nargs="+", default=None,
                      help=f"factor widths d (default {' '.join(map(str, WIDTHS))}; "
                           f"--quick: {' '.join(map(str, QUICK_WIDTHS))})")
  parser.add_argument("--rows", type=int, default=128, help="rows m behind F = X^T X / m")
  parser.add_argument("--repeats", type=int, default=None,
                      help="timed calls per case (default 20; --quick: 3)")
  parser.add_argument("--warmup", type=int, default=2,
                      help="untimed calls per case before timing (the first compiles)")
  parser.add_argument("--stat", choices=("median", "min"), default="median",
                      help="statistic of the timed calls")
  parser.add_argument("--budget", type=float, default=5.0,
                      help="seconds per case after which timing stops (at least 3 calls)")
  parser.add_argument("--max-unsplit-eigh", type=int, default=4096,
                      help="skip unsplit eigh for wider factors")
  parser.add_argument("--max-unsplit", type=int, default=None,
                      help="skip every unsplit method for wider factors (default: none skipped)")
  parser.add_argument("--tol", type=float, default=1e-3, help="flag relative errors above this")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--quick", action="store_true",
                      help="smoke run: widths 256 512 1024, 3 repeats (unless given)")
  parser.add_argument("--forms", action="store_true",
                      help="instead: table 3, the CPU loop against batched LAPACK and "
                           "Newton-Schulz")
  parser.add_argument("--forms-blocks", type=int, nargs="+", default=[8, 22, 32],
                      help="--forms: blocks per stack (default: %(default)s)")
  parser.add_argument("--forms-iterations", type=int, nargs="+", default=[12, 16],
                      help="--forms: Newton-Schulz iterations (default: %(default)s)")
  args = parser.parse_args(argv)
  if args.warmup < 1 or (args.repeats is not None and args.repeats < 1):
    parser.error("--warmup and --repeats must be at least 1")
  if args.widths is None:
    args.widths = list(QUICK_WIDTHS if args.quick else WIDTHS)
  args.widths = list(dict.fromkeys(args.widths))
  if args.repeats is None:
    args.repeats = 3 if args.quick else 20

  if args.forms:
    forms_table(args)
    return
  device = jax.devices()[0]
  print(f"jax {jax.__version__}, backend {jax.default_backend()}, device {device.device_kind} "
        f"({device}), {os.cpu_count()} CPU cores", flush=True)
  print(f"F = X^T X / m, m = {args.rows} rows, float32; damping sqrt({DAMPING}) = "
        f"{math.sqrt(DAMPING):.4f} per factor; split = {BLOCK}-blocks; {args.stat} of up to "
        f"{args.repeats} calls after {args.warmup} warm-up (budget {args.budget:g} s per case)",
        flush=True)

  results = {}
  for d in args.widths:
    t0 = time.perf_counter()
    results[d] = measure(d, args)
    print(f"  d = {d}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)

  headers = ["d"] + [f"{m} {l}" for m in METHODS for l in LAYOUTS] + [
      "woodbury vs cholesky (unsplit / split)", "eigh reconstruction (unsplit / split)"]
  rows = []
  for d, r in results.items():
    cells = [str(d)]
    for method in METHODS:
      for layout in LAYOUTS:
        mark = method == "woodbury" and args.rows >= r["block"][layout]
        cells.append(fmt_ms(r["ms"][(method, layout)], mark))
    cells += [fmt_err(r["woodbury_err"], args.tol), fmt_err(r["eigh_err"], args.tol)]
    rows.append(cells)
  print("\n1. Inversion time (ms) by width, whole factor (unsplit) vs 128-blocks (split)\n")
  print(markdown(headers, rows))
  print(f"\n`*`: m = {args.rows} >= block size b, Woodbury's m x m core is not smaller than "
        f"the block. `-`: skipped. Errors: max relative difference; `!`: above {args.tol:g}.")

  rows = []
  for d, r in results.items():
    cells = [str(d)]
    for method in METHODS:
      whole, split = r["ms"][(method, "unsplit")], r["ms"][(method, "split")]
      cells.append("-" if whole is None or split is None else f"{whole / split:.2f}x")
    rows.append(cells)
  print("\n2. Speed-up of split over unsplit (unsplit ms / split ms)\n")
  print(markdown(["d"] + list(METHODS), rows))


if __name__ == "__main__":
  main()
