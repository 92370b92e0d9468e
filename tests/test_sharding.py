"""Scale-out on JAX's own sharding: data parallel, distributed inversion, several processes.

The test processes have 4 host CPU devices (``conftest.py``); the problem is
``distributed_setup.py``'s (16 factor blocks of 16, three THOR steps: check, plain, check).
"""

import os
import re
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import distributed_setup as setup
import thor_optax
import reference
from reference import inverse_blocks

pytestmark = pytest.mark.usefixtures("fast_compiles")

# Data-parallel sums run in another order than one device's: equal up to float32 rounding.
F32 = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def mesh():
  assert len(jax.devices()) == 4, "conftest.py should give 4 host devices"
  return Mesh(np.array(jax.devices()), ("data",))


@pytest.fixture(scope="module")
def single_device():
  return setup.train()


def _assert_same_params(got, want):
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), **F32),
               got, want)


def test_data_parallel_equals_single_device(mesh, single_device):
  params, state = setup.train(mesh)
  _assert_same_params(params, single_device[0])
  inner = reference.kronecker_state(state)
  assert int(inner.diagnostics["Dense_0"].total_refreshes) == 2 * 9  # two checks, 7 + 2 blocks
  assert inverse_blocks(inner)["b16"].sharding.is_fully_replicated


def _blocks_per_device(mesh, distribute_inversion):
  """How many 16 x 16 blocks one device factorizes in the compiled check step: on CPU the package
  runs LAPACK one block at a time (``linalg.lapack_safe``), so each budget of a batched refresh
  is a loop whose trip count is its number of blocks, and a sequential refresh
  (``blocks.sequential_block_update``) a loop whose trip count is known only at run time
  (``None`` in the set)."""
  model, tx = setup.Net(), setup.optimizer(
      NamedSharding(mesh, P("data")) if distribute_inversion else None)
  x, y = setup.data()[0]
  params = model.init(jax.random.PRNGKey(1), x)["params"]
  capture = thor_optax.flax.value_and_grad_with_stats(model, setup.loss_fn)

  def check(params, state, x, y):
    (_, grads), stats = capture(params, x, y)
    return tx.update(grads, state, params, curvature_stats=stats)

  rep, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  hlo = jax.jit(check, in_shardings=(rep, rep, batch, batch)).lower(
      params, tx.init(params), x, y).compile().as_text()
  bodies = {}  # computation name -> its text
  for comp in re.split(r"\n(?=\S)", hlo):
    m = re.match(r"%?([\w.\-]+)", comp)
    if m:
      bodies[m.group(1)] = comp
  counts = set()
  for line in hlo.splitlines():
    m = re.search(r"while\(.*body=%?([\w.\-]+)", line)
    if m and re.search(r"potrf.*f32\[1,16,16\]|f32\[1,16,16\].*potrf", bodies.get(m.group(1), "")):
      n = re.search(r"known_trip_count\":\{\"n\":\"(\d+)", line)
      counts.add(int(n.group(1)) if n else None)
  assert counts, "no loop of 16 x 16 Cholesky factorizations in the compiled check step"
  return counts, hlo


def test_distributed_inversion_divides_the_work(mesh):
  """With ``block_sharding`` each device factorizes at most a quarter of a stack's blocks."""
  whole, hlo = _blocks_per_device(mesh, distribute_inversion=False)
  divided, _ = _blocks_per_device(mesh, distribute_inversion=True)
  # on one device, the blocks due one at a time: a loop of as many trips as blocks are due; with
  # block_sharding, the refresh budgets of the 16-block group (the default 2 buckets: 8 and 16
  # blocks) divided over the 4 devices.
  assert whole == {None}
  assert divided == {2, 4}
  assert "all-reduce" in hlo  # the statistics are reduced over the data axis by the compiler


@pytest.mark.parametrize("block_axis", [None, "data"], ids=["comm_opt", "mem_opt"])
def test_distributed_inversion_equals_single_device(mesh, single_device, block_axis):
  params, state = setup.train(mesh, block_axis=block_axis, distribute_inversion=True)
  _assert_same_params(params, single_device[0])
  inv = inverse_blocks(reference.kronecker_state(state))["b16"]
  want = (16, 16, 16) if block_axis is None else (4, 16, 16)  # MEM-OPT: a quarter per device
  assert inv.sharding.shard_shape(inv.shape) == want
  assert list(inverse_blocks(reference.kronecker_state(state))) == ["b16"]  # small G padded in
  np.testing.assert_allclose(np.asarray(inv), np.asarray(inverse_blocks(reference.kronecker_state(single_device[1]))["b16"]),
                             **F32)


def test_state_sharding_rejects_unknown_axis(mesh, single_device):
  with pytest.raises(ValueError, match="'model' is not an axis"):
    thor_optax.kronecker_state_sharding(single_device[1], mesh, "model")


@pytest.mark.parametrize("make", [lambda mesh: mesh, lambda mesh: NamedSharding(mesh, P()),
                                  lambda mesh: NamedSharding(mesh, P(None, "data"))],
                         ids=["mesh", "replicated", "second_axis"])
def test_block_sharding_that_divides_nothing_is_rejected(mesh, make):
  """A Mesh (crashed at the first check step) or a spec that does not split the block stacks'
  leading axis (every device inverted every block, silently) is rejected when built."""
  with pytest.raises(ValueError, match=r"block_sharding must be None or a jax.sharding"):
    thor_optax.thor(0.1, block_sharding=make(mesh))


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_match_single_process(tmp_path, single_device):
  """Two ``jax.distributed`` processes on loopback (gloo CPU collectives), one device each."""
  port = _free_port()
  here = os.path.dirname(os.path.abspath(__file__))
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
  workers = [subprocess.Popen(
      [sys.executable, os.path.join(here, "distributed_setup.py"), str(i), str(port),
       str(tmp_path / f"params_{i}.npz")], env=env, stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True) for i in range(2)]
  for w in workers:
    out, _ = w.communicate(timeout=240)
    assert w.returncode == 0, out[-3000:]
  results = [dict(np.load(tmp_path / f"params_{i}.npz")) for i in range(2)]
  want = {jax.tree_util.keystr(path): np.asarray(leaf)
          for path, leaf in jax.tree_util.tree_flatten_with_path(single_device[0])[0]}
  assert set(results[0]) == set(want)
  for name in want:
    np.testing.assert_array_equal(results[0][name], results[1][name])  # identical replicas
    np.testing.assert_allclose(results[0][name], want[name], err_msg=name, **F32)
