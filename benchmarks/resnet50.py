"""THOR's steps against SGD, Adam and Muon on a ResNet-50 at batch 256, bfloat16 activations.

THOR's paper reports, for ResNet-50 on ImageNet, a training step whose cost is close to SGD's
on accelerators. This script measures that claim for ``thor_optax`` on whatever JAX runs on
(meant for a GPU; ``--image-size 32 --batch-size 8`` makes a CPU run of the same code):

* model: a ResNet-50 (v1.5, bottleneck blocks, stages ``(3, 4, 6, 3)``, 64 base filters, 1000
  classes) written in the style of the Flax ImageNet example: ``partial``-bound ``nn.Conv``
  (no bias) and ``nn.BatchNorm`` factories, activations in ``--dtype`` (bfloat16) with float32
  parameters, the logits cast back to float32 for the loss; the curvature state is float32
  (``thor_optax``'s default for float32 parameters);
* data: random images and labels (a timing benchmark: the step costs do not depend on pixel
  values; nothing downloads). Two batches alternate, so that the trace rule sees new statistics;
* optimizers: ``optax.sgd(0.1, momentum=0.9)``, ``optax.adam(1e-3)``, ``optax.contrib.muon``
  (convolution kernels as ``(kh kw c_in, c_out)`` matrices, the head, biases and BatchNorms to
  its Adam part) and ``thor_optax.thor(0.05, 0.3)`` (128-blocks, the alias's defaults;
  BatchNorms preconditioned unit-wise). THOR's steps are those of ``benchmarks/mnist.py``: a
  *check step* passes the captured statistics as ``curvature_stats=`` and ``gradient_stats=``,
  a *plain step* as ``gradient_stats=`` (sample space where a layer has fewer rows than block
  dimensions: the head). Every step donates the variables and the optimizer state.

Printed, per step function: its compile time (``jit(...).lower(...).compile()``, trace
included, seconds) and the median wall time of ``--repeats`` steps in interleaved rounds
(``timing.interleaved_ms``), with its ratio to SGD, Adam and Muon. THOR's check step is timed
twice: with every block refreshed (``trace_thresholds=(0, 0)``, the worst case) and with the
trace rule (``(0.01, 0)``: the alias's default) on alternating batches, with the fraction of
blocks it refreshed. The amortized THOR step is the mean over the first ``--steps`` steps of
``growing_interval(5, 50, 200)`` (the schedule of ``benchmarks/mnist.py``) if every check
refreshed every block: an upper bound.

Run::

    python3 benchmarks/resnet50.py                       # batch 256, 224x224, bfloat16 (GPU)
    python3 benchmarks/resnet50.py --image-size 32 --batch-size 8 --repeats 3   # a CPU check
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
import warnings
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mnist  # noqa: E402  (benchmarks/mnist.py: the README's jitted steps)
import options  # noqa: E402
from timing import interleaved_ms  # noqa: E402

import thor_optax  # noqa: E402

ModuleDef = Any
REFERENCES = ("sgd", "adam", "muon")


class BottleneckBlock(nn.Module):
  """1x1 - 3x3 (strided) - 1x1 convolutions, BatchNorm after each, projection on a shape change."""

  filters: int
  conv: ModuleDef
  norm: ModuleDef
  strides: tuple[int, int] = (1, 1)

  @nn.compact
  def __call__(self, x):
    residual = x
    y = nn.relu(self.norm()(self.conv(self.filters, (1, 1))(x)))
    y = nn.relu(self.norm()(self.conv(self.filters, (3, 3), self.strides)(y)))
    y = self.norm(scale_init=nn.initializers.zeros_init())(self.conv(self.filters * 4, (1, 1))(y))
    if residual.shape != y.shape:
      residual = self.conv(self.filters * 4, (1, 1), self.strides, name="conv_proj")(residual)
      residual = self.norm(name="norm_proj")(residual)
    return nn.relu(residual + y)


class ResNet(nn.Module):
  """ResNet v1.5 with bottleneck blocks; ``stage_sizes=(3, 4, 6, 3)`` is ResNet-50."""

  stage_sizes: Sequence[int] = (3, 4, 6, 3)
  num_filters: int = 64
  num_classes: int = 1000
  dtype: Any = jnp.bfloat16

  @nn.compact
  def __call__(self, x, train: bool = True):
    conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype)
    norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9,
                             epsilon=1e-5, dtype=self.dtype)
    x = conv(self.num_filters, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], name="conv_init")(x)
    x = nn.relu(norm(name="bn_init")(x))
    x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
    for i, blocks in enumerate(self.stage_sizes):
      for j in range(blocks):
        strides = (2, 2) if i > 0 and j == 0 else (1, 1)
        x = BottleneckBlock(self.num_filters * 2**i, conv=conv, norm=norm, strides=strides)(x)
    x = jnp.mean(x, axis=(1, 2))
    x = nn.Dense(self.num_classes, dtype=self.dtype, name="head")(x)
    return jnp.asarray(x, jnp.float32)


def muon_dimension_numbers(params: Any) -> Any:
  """Muon's matrix axes: every convolution kernel as ``(kh kw c_in, c_out)``; the head, biases
  and BatchNorm parameters (``None``) take Muon's Adam steps."""
  dims = optax.contrib.MuonDimensionNumbers

  def spec(path, leaf):
    if str(path[-1].key) != "kernel" or leaf.ndim != 4:
      return None
    return dims(reduction_axis=(0, 1, 2), output_axis=3)

  return jax.tree_util.tree_map_with_path(spec, params)


class Runner:
  """A donated step function with its own ``(variables, opt_state)``, fed alternating batches."""

  def __init__(self, step: Callable, variables: Any, opt_state: Any, batches: list):
    self.step, self.variables, self.opt_state, self.batches = step, variables, opt_state, batches
    self.calls = 0

  def __call__(self):
    x, y = self.batches[self.calls % len(self.batches)]
    self.calls += 1
    self.variables, self.opt_state, loss = self.step(self.variables, self.opt_state, x, y)
    return loss


def compiled(step: Callable, *args) -> tuple[Callable, float]:
  """``(compiled step, seconds)`` of ``step.lower(*args).compile()`` (trace included)."""
  t0 = time.perf_counter()
  fn = step.lower(*args).compile()
  return fn, time.perf_counter() - t0


def copy(tree: Any) -> Any:
  """A fresh copy of every array (each runner donates its own)."""
  return jax.tree.map(jnp.array, tree)


def main(argv=None) -> None:
  """Parses the arguments, compiles and times every step, prints the table."""
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--batch-size", type=int, default=256)
  p.add_argument("--image-size", type=int, default=224)
  p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
  p.add_argument("--block-size", type=int, default=128)
  p.add_argument("--repeats", type=int, default=10, help="timed steps per round (5 rounds)")
  p.add_argument("--steps", type=int, default=1000, help="steps of the amortized THOR step")
  options.add_lapack_threads_option(p)
  args = p.parse_args(argv)
  options.apply_lapack_threads(args)
  warnings.filterwarnings("ignore", message="curvature_stats: layers not preconditioned")

  model = ResNet(dtype=jnp.dtype(args.dtype))
  rng = np.random.default_rng(0)
  shape = (args.batch_size, args.image_size, args.image_size, 3)
  batches = [(jnp.asarray(rng.standard_normal(shape, np.float32)),
              jnp.asarray(rng.integers(0, 1000, args.batch_size))) for _ in range(2)]
  variables = jax.jit(functools.partial(model.init, train=True))(jax.random.PRNGKey(0),
                                                                  batches[0][0])
  params = variables["params"]
  num_params = sum(int(np.prod(v.shape)) for v in jax.tree.leaves(params))
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; "
        f"ResNet-50 ({num_params / 1e6:.1f}M parameters), batch {args.batch_size}, "
        f"{args.image_size}x{args.image_size}, "
        f"{args.dtype} activations, float32 parameters and curvature", flush=True)

  references = {
      "sgd": optax.sgd(0.1, momentum=0.9), "adam": optax.adam(1e-3),
      "muon": optax.contrib.muon(0.02, adam_learning_rate=1e-3,
                                 muon_weight_dimension_numbers=muon_dimension_numbers)}
  thor_kwargs = dict(block_size=args.block_size)
  thor_all = thor_optax.thor(0.05, 0.3, trace_thresholds=(0.0, 0.0), **thor_kwargs)
  thor_rule = thor_optax.thor(0.05, 0.3, **thor_kwargs)

  runners, compile_s = {}, {}
  x0, y0 = batches[0]
  for name, tx in references.items():
    _, step = mnist.make_steps(model, tx, donate=True)
    state = tx.init(params)
    fn, compile_s[name] = compiled(step, variables, state, x0, y0)
    runners[name] = Runner(fn, copy(variables), state, batches)
    print(f"  compiled {name}: {compile_s[name]:.1f} s", flush=True)
  for label, tx in (("thor check, every block", thor_all), ("thor check, trace rule", thor_rule)):
    check, plain = mnist.make_steps(model, tx, sample_space=True, donate=True)
    state = tx.init(params)
    fn, seconds = compiled(check, variables, state, x0, y0)
    if label.endswith("every block"):
      compile_s["thor check"] = seconds
      plain_fn, compile_s["thor plain"] = compiled(plain, variables, state, x0, y0)
    runner = Runner(fn, copy(variables), state, batches)
    jax.block_until_ready(runner())  # the first check refreshes every block
    runners[label] = runner
    if label.endswith("every block"):
      runners["thor plain"] = Runner(plain_fn, copy(runner.variables), copy(runner.opt_state),
                                     batches)
    print(f"  compiled {label}", flush=True)

  ms = interleaved_ms(runners, args.repeats)
  diagnostics = optax.tree_utils.tree_get(runners["thor check, trace rule"].opt_state,
                                          "diagnostics").values()
  refreshed = (sum(int(d.blocks_refreshed) for d in diagnostics),
               sum(int(d.num_blocks) for d in diagnostics))
  schedule = options.check_schedule((5, 50, 200))
  checks = sum(schedule(s) for s in range(args.steps))
  ms["thor amortized"] = (checks * ms["thor check, every block"]
                          + (args.steps - checks) * ms["thor plain"]) / args.steps

  header = (f"{'step':26s} {'ms':>9s} {'x sgd':>7s} {'x adam':>7s} {'x muon':>7s} "
            f"{'compile s':>9s}")
  print(f"\nmedian ms of {5 * args.repeats} steps in 5 interleaved rounds")
  print(header)
  print("-" * len(header))
  compile_of = {"thor check, every block": "thor check", "thor plain": "thor plain"}
  for name, value in ms.items():
    ratios = " ".join(f"{value / ms[r]:7.2f}" for r in REFERENCES)
    comp = compile_s.get(compile_of.get(name, name))
    print(f"{name:26s} {value:9.2f} {ratios} {'' if comp is None else f'{comp:9.1f}'}")
  print(f"\ntrace rule on alternating batches: {refreshed[0]} of {refreshed[1]} blocks refreshed "
        f"at the last check; amortized: {checks} checks in {args.steps} steps of "
        f"growing_interval(5, 50, 200), each refreshing every block; check / plain compile "
        f"{compile_s['thor check'] / compile_s['thor plain']:.2f}x")


if __name__ == "__main__":
  main()
