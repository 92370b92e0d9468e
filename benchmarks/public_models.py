"""What THOR preconditions, and what its steps cost, on models written like public Flax code.

For every linen model of ``tests/public_models.py`` (ResNet with BatchNorm, a decoder-only
transformer scanned over ``nn.remat``-ed blocks, an LSTM classifier, tuple / dict / dataclass
outputs, a tied-embedding LM, a bare ``nn.Dense``, a weight-standardized conv, a rank-1
regressor, ``nn.remat`` layers; tiny sizes, a fixed synthetic batch), one table row:

* **preconditioned**: the share of the model's scalar parameters that THOR preconditions, after
  one check step: the scalars of the layers whose ``total_refreshes > 0`` in the optimizer
  state's diagnostics, plus those of normalization layers whose unit-wise 2x2 inverse was
  refreshed (they have no diagnostics), over all scalars. Layers the capture lists as unhandled
  (attention, LSTM cells, tied embeddings, weight-standardized convs, position embeddings) are
  the rest;
* **check / plain / SGD ms**: median wall time of ``--repeats`` calls, after a warm-up call, of
  the README's jitted check step (capture + ``tx.update(..., curvature_stats=stats)``), its plain
  step (``jax.value_and_grad`` + ``tx.update``), and the same plain step with
  ``optax.sgd(lr, momentum=0.9)`` as the optimizer, with ``jax.block_until_ready``;
* **check / plain compile s**: ``jax.jit(step).lower(...).compile()`` timed (XLA's default
  options; the trace is included).

The optimizer is ``thor_optax.thor(learning_rate, 0.03)`` with its defaults (block size 128,
THOR's trace rule). The first check step refreshes every block, so the check step timed is the
steady-state one (the trace rule then keeps blocks whose traces did not move).

Run (about two minutes on two CPU cores)::

    python3 benchmarks/public_models.py
    python3 benchmarks/public_models.py --models resnet transformer --repeats 50
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import flax.linen as nn
import jax
import numpy as np
import optax

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
sys.path.insert(0, os.path.join(_ROOT, "tests"))

import public_models as pm  # noqa: E402  (the model definitions)
from timing import median_ms  # noqa: E402
import options  # noqa: E402  (benchmarks/options.py, beside this script)
import thor_optax  # noqa: E402

DAMPING = 0.03


def compiled(step, *args):
  """``(compiled step, seconds)`` of ``jax.jit(step).lower(*args).compile()``."""
  t0 = time.perf_counter()
  fn = jax.jit(step).lower(*args).compile()
  return fn, time.perf_counter() - t0


def kronecker_state(opt_state) -> thor_optax.KroneckerState:
  """The ``KroneckerState`` inside an optimizer state."""
  return next(s for s in jax.tree.leaves(
      opt_state, is_leaf=lambda v: isinstance(v, thor_optax.KroneckerState))
              if isinstance(s, thor_optax.KroneckerState))


def preconditioned_layers(state: thor_optax.KroneckerState) -> set[str]:
  """Layers with ``total_refreshes > 0``, and normalization layers whose unit-wise inverse was
  refreshed (it leaves the identity)."""
  names = {name for name, d in state.diagnostics.items() if int(d.total_refreshes) > 0}
  for name, side in state.layers.items():
    if name not in state.diagnostics and hasattr(side, "inverse"):
      if not np.allclose(side.inverse, np.eye(2)):
        names.add(name)
  return names


def scalars_by_layer(params) -> dict[str, int]:
  """``{layer name: number of scalar parameters}`` (``'(root)'`` for root parameters; boxed,
  logically partitioned parameters unboxed)."""
  out: dict[str, int] = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(nn.meta.unbox(params))[0]:
    name = "/".join(str(k.key) for k in path[:-1]) or "(root)"
    out[name] = out.get(name, 0) + int(np.prod(leaf.shape))
  return out


def measure(case: pm.Case, repeats: int) -> dict:
  """One row of the table for ``case``."""
  params, model_state, (x, y) = pm.init_case(case)
  tx = thor_optax.thor(case.learning_rate, DAMPING,
                       layers=pm.captured_layout(case, params, model_state, (x, y)))
  sgd = optax.sgd(case.learning_rate, momentum=0.9)
  unhandled = []
  check_step, plain_step = pm.make_steps(case, tx, on_stats=lambda s: unhandled.append(s.unhandled))
  _, sgd_step = pm.make_steps(case, sgd)
  opt_state, sgd_state = tx.init(params), sgd.init(params)
  args = (params, model_state, opt_state, x, y)
  check, check_s = compiled(check_step, *args)
  plain, plain_s = compiled(plain_step, *args)
  sgd_fn, _ = compiled(sgd_step, params, model_state, sgd_state, x, y)

  # After a first check step: the share preconditioned, and the steady state that is timed.
  params1, state1, opt_state1, _ = check(*args)
  layers = scalars_by_layer(params)
  done = preconditioned_layers(kronecker_state(opt_state1))
  args1 = (params1, state1, opt_state1, x, y)
  return dict(
      scalars=sum(layers.values()),
      share=sum(n for name, n in layers.items() if name in done) / sum(layers.values()),
      layers=f"{len(done)}/{len(layers)}",
      check_ms=median_ms(lambda: check(*args1), repeats),
      plain_ms=median_ms(lambda: plain(*args1), repeats),
      sgd_ms=median_ms(lambda: sgd_fn(params1, state1, sgd_state, x, y), repeats),
      check_s=check_s, plain_s=plain_s, unhandled=unhandled[0])


def main(argv=None) -> None:
  """Parses the arguments and prints the table."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--models", nargs="+", default=list(pm.LINEN_MODELS),
                      choices=list(pm.LINEN_MODELS))
  parser.add_argument("--repeats", type=int, default=20)
  options.add_lapack_threads_option(parser)
  args = parser.parse_args(argv)
  options.apply_lapack_threads(args)

  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {os.cpu_count()} CPU cores; "
        f"thor_optax.thor(lr, {DAMPING}), median ms of {args.repeats} steps, compile s")
  header = (f"{'model':17s} {'params':>7s} {'precond.':>8s} {'layers':>6s} {'check ms':>9s} "
            f"{'plain ms':>9s} {'SGD ms':>7s} {'check/SGD':>9s} {'plain/SGD':>9s} "
            f"{'check comp s':>12s} {'plain comp s':>12s}")
  print(header)
  print("-" * len(header))
  notes = {}
  # The check steps warn about the layers they leave alone; they are listed below the table.
  warnings.filterwarnings("ignore", message="curvature_stats: layers not preconditioned")
  for name in args.models:
    r = measure(pm.LINEN_MODELS[name], args.repeats)
    notes[name] = r["unhandled"]
    print(f"{name:17s} {r['scalars']:7d} {r['share']:8.1%} {r['layers']:>6s} "
          f"{r['check_ms']:9.2f} {r['plain_ms']:9.2f} {r['sgd_ms']:7.2f} "
          f"{r['check_ms'] / r['sgd_ms']:9.1f} {r['plain_ms'] / r['sgd_ms']:9.1f} "
          f"{r['check_s']:12.2f} {r['plain_s']:12.2f}", flush=True)
  print("\nnot preconditioned (stats.unhandled):")
  for name, unhandled in notes.items():
    for note in unhandled:
      print(f"  {name}: {note}")


if __name__ == "__main__":
  main()
