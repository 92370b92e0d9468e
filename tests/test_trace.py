"""THOR's trace rule: unit tests of the regimes and end-to-end refresh counts in the transform."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import thor_optax
import reference
from reference import inverse_blocks, stack_field
from thor_optax._src import blocks
from thor_optax._src import check_step
from thor_optax._src import linalg
from thor_optax._src.refresh import trace_rule as trace

D_IN, D_OUT, N, B = 12, 6, 32, 4  # A: 3 blocks of 4 (no bias); G: 2 blocks of 4, last padded


def _params():
  return {"dense": {"kernel": jnp.zeros((D_IN, D_OUT), jnp.float32)}}


def _stats(inputs, cotangents):
  return thor_optax.CurvatureStats(
      layers={"dense": thor_optax.DenseStats(inputs=inputs, cotangents=cotangents[None])})


def _data(seed):
  ka, kg = jax.random.split(jax.random.PRNGKey(seed))
  return jax.random.normal(ka, (N, D_IN)), jax.random.normal(kg, (N, D_OUT))


def _run_checks(tx, stats_seq):
  """Runs one check step per statistics in ``stats_seq``; returns the states after each."""
  params = _params()
  state = tx.init(params)
  update = jax.jit(lambda s, st: tx.update(params, s, params, curvature_stats=st)[1])
  states = []
  for st in stats_seq:
    state = update(state, st)
    states.append(state)
  return states


def _refreshed_per_check(states):
  totals = [int(sum(np.sum(r) for r in stack_field(s, "record", "refreshes").values())) for s in states]
  return np.diff([0] + totals)


def test_rule_regimes():
  ref = jnp.array([0.0, 1.0, 1.0, 1.0, 1.0])
  now = jnp.array([5.0, 1.5, 1.005, 1.0001, 3.0])
  frozen = jnp.array([False, False, False, False, True])
  valid = jnp.ones(5, bool)
  d = trace.trace_rule(now, ref, frozen, valid, omega1=0.01, omega2=0.001)
  np.testing.assert_array_equal(d.refresh, [True, True, False, False, False])
  np.testing.assert_array_equal(d.freeze, [False, False, False, True, False])
  np.testing.assert_allclose(d.ratio, [0.0, 0.5, 0.005, 1e-4, 0.0], rtol=1e-3)
  # Invalid (non-finite) statistics: neither refreshed nor frozen.
  d = trace.trace_rule(now, ref, frozen, jnp.zeros(5, bool), 0.01, 0.001)
  assert not d.refresh.any() and not d.freeze.any()


def test_rule_zero_thresholds_always_refresh():
  ref = jnp.array([1.0, 2.0, 3.0])
  d = trace.trace_rule(ref, ref, jnp.zeros(3, bool), jnp.ones(3, bool), 0.0, 0.0)
  assert d.refresh.all() and not d.freeze.any()


def test_invalid_thresholds_raise():
  with pytest.raises(ValueError, match="omega2 <= omega1"):
    thor_optax.scale_by_thor(trace_thresholds=(0.001, 0.01))


def test_zero_thresholds_refresh_every_block_every_check():
  tx = thor_optax.scale_by_thor(0.1, block_size=B, trace_thresholds=(0.0, 0.0))
  states = _run_checks(tx, [_stats(*_data(s)) for s in range(3)])
  n_blocks = 3 + 2
  np.testing.assert_array_equal(_refreshed_per_check(states), [n_blocks] * 3)
  diag = states[-1].diagnostics["dense"]
  assert int(diag.blocks_refreshed) == n_blocks and int(diag.total_refreshes) == 3 * n_blocks


def test_huge_omega1_refreshes_only_first_check():
  tx = thor_optax.scale_by_thor(0.1, block_size=B, trace_thresholds=(1e9, 0.0))
  states = _run_checks(tx, [_stats(*_data(s)) for s in range(3)])
  np.testing.assert_array_equal(_refreshed_per_check(states), [5, 0, 0])
  for g in inverse_blocks(states[0]):
    np.testing.assert_array_equal(inverse_blocks(states[0])[g], inverse_blocks(states[-1])[g])
  assert float(states[-1].diagnostics["dense"].trace_ratio) > 0


def test_frozen_blocks_never_refresh_again():
  # omega2 huge: the second check freezes every block; a large trace jump later changes nothing.
  tx = thor_optax.scale_by_thor(0.1, block_size=B, trace_thresholds=(1e9, 1e9))
  a, g = _data(0)
  states = _run_checks(tx, [_stats(a, g), _stats(a, g), _stats(100 * a, 100 * g)])
  np.testing.assert_array_equal(_refreshed_per_check(states), [5, 0, 0])
  assert all(bool(f.all()) for f in stack_field(states[1], "policy", "frozen").values())
  assert int(states[-1].diagnostics["dense"].frozen_blocks) == 5
  for g_ in inverse_blocks(states[0]):
    np.testing.assert_array_equal(inverse_blocks(states[0])[g_], inverse_blocks(states[-1])[g_])


@pytest.mark.parametrize("refresh_buckets", [None, 1, 2, 4])
def test_known_trace_jump_refreshes_exactly_the_blocks_that_jumped(refresh_buckets, monkeypatch):
  options = {}
  if refresh_buckets is not None:
    # Every factor's covariance in budgets, as a costly factor's (None: these small factors
    # multiplied out whole): one of A's 3 blocks is due, formed in a budget of 3, 2 or 1.
    monkeypatch.setattr(check_step, "_WHOLE_COVARIANCE_FLOPS", 0)
    options["refresh_buckets"] = refresh_buckets
  tx = thor_optax.scale_by_thor(0.1, block_size=B, trace_thresholds=(0.01, 0.0), **options)
  a, g = _data(0)
  a2 = a.at[:, 4:8].multiply(3.0)   # A's block 1 jumps (trace x9), blocks 0 and 2 unchanged
  g2 = g.at[:, 0:4].multiply(0.5)   # G's block 0 drops (trace x0.25), block 1 unchanged
  states = _run_checks(tx, [_stats(a, g), _stats(a2, g2)])
  layout = blocks.build_layout(_params(), B)
  spec = layout.layers[0]
  refreshes = states[1].blocks[spec.a.group]["record"].refreshes
  np.testing.assert_array_equal(refreshes[spec.a.start:spec.a.stop], [1, 2, 1])
  np.testing.assert_array_equal(refreshes[spec.g.start:spec.g.stop], [2, 1])
  assert int(states[1].diagnostics["dense"].blocks_refreshed) == 2
  # The damped trace of A's block 1 grows from t + 4 sqrt(lambda) to 9 t + 4 sqrt(lambda).
  t = float(jnp.sum(a[:, 4:8] ** 2)) / N
  expected_ratio = 8 * t / (t + 4 * np.sqrt(0.1))
  np.testing.assert_allclose(float(states[1].diagnostics["dense"].trace_ratio), expected_ratio,
                             rtol=1e-4)
  # Unrefreshed blocks keep their inverses exactly; refreshed ones change.
  inv0, inv1 = inverse_blocks(states[0])[spec.a.group], inverse_blocks(states[1])[spec.a.group]
  changed = [not np.array_equal(inv0[i], inv1[i]) for i in range(len(inv0))]
  expected = np.zeros(len(inv0), bool)
  expected[spec.a.start + 1] = expected[spec.g.start] = True
  np.testing.assert_array_equal(changed, expected)
  # ... to the inverses that a first check on the second batch gives those blocks.
  fresh = inverse_blocks(_run_checks(thor_optax.scale_by_thor(0.1, block_size=B),
                                     [_stats(a2, g2)])[0])[spec.a.group]
  np.testing.assert_allclose(inv1[expected], fresh[expected], rtol=1e-6, atol=1e-7)


def test_bounded_rule_refreshes_a_block_skipped_max_stale_checks_in_a_row():
  # Unchanged traces: THOR's rule keeps every stale inverse; the bound refreshes a live block
  # after K skipped checks. Block 2 has invalid statistics at checks 2-4 (its count waits),
  # block 3 is frozen from the start.
  policy = trace.TraceRule(0.01, 0.0, max_stale_checks=2)
  state = policy.init(4, jnp.float32)._replace(frozen=jnp.array([False, False, False, True]))
  ref, now = jnp.zeros(4), jnp.ones(4)
  pattern = []
  for check in range(7):
    valid = jnp.array([True, True, not 1 <= check <= 3, True])
    sel = policy.select(now, ref, state, valid, jnp.int32(check))
    ref = jnp.where(sel.refresh, now, ref)
    state = sel.state
    pattern.append(np.asarray(sel.refresh).astype(int).tolist())
  np.testing.assert_array_equal(np.array(pattern).T, [
      [1, 0, 0, 1, 0, 0, 1],
      [1, 0, 0, 1, 0, 0, 1],
      [1, 0, 0, 0, 0, 0, 1],
      [0, 0, 0, 0, 0, 0, 0]])
  np.testing.assert_array_equal(state.skipped, [0, 0, 0, 0])


def _rotated(x, seed, sizes):
  """``x`` with its columns turned by a random rotation inside each block of ``sizes``:
  every block's trace is kept, its covariance is not (as a LayerNorm's output turns)."""
  keys = jax.random.split(jax.random.PRNGKey(seed), len(sizes))
  qs = [jnp.linalg.qr(jax.random.normal(k, (n, n)))[0] for k, n in zip(keys, sizes)]
  return x @ jax.scipy.linalg.block_diag(*qs)


def test_bounded_rule_in_the_transform_refreshes_stale_blocks_exactly():
  # Batches whose block traces agree but whose covariances do not: the trace rule alone
  # refreshes nothing after the first check; with max_stale_checks=1 every block is refreshed
  # at every second check, to the inverses a fresh state's first check gives that batch.
  a, g = _data(0)
  seq = [_stats(a, g)] + [_stats(_rotated(a, k, [4, 4, 4]), _rotated(g, 10 + k, [4, 2]))
                          for k in range(1, 5)]
  plain = _run_checks(thor_optax.scale_by_thor(0.1, block_size=B), seq)
  np.testing.assert_array_equal(_refreshed_per_check(plain), [5, 0, 0, 0, 0])
  states = _run_checks(thor_optax.scale_by_thor(0.1, block_size=B, max_stale_checks=1), seq)
  np.testing.assert_array_equal(_refreshed_per_check(states), [5, 0, 5, 0, 5])
  fresh = inverse_blocks(_run_checks(thor_optax.scale_by_thor(0.1, block_size=B), seq[2:3])[0])
  for g_ in fresh:
    assert not np.allclose(inverse_blocks(plain[2])[g_], fresh[g_], atol=1e-3)
    np.testing.assert_allclose(inverse_blocks(states[2])[g_], fresh[g_], rtol=1e-6, atol=1e-7)
  assert set(stack_field(states[-1], "policy", "skipped")) == set(fresh)
  assert not stack_field(plain[-1], "policy", "skipped")  # the state is sized to the option
  assert "max_stale_checks=1" in trace.TraceRule(0.01, 0.0, 1).describe()


@pytest.mark.parametrize("bad", [0, 1.5, True, "2"])
def test_refresh_buckets_must_be_a_count(bad):
  with pytest.raises(ValueError, match=r"scale_by_thor: refresh_buckets must be an int >= 1"):
    thor_optax.scale_by_thor(0.1, refresh_buckets=bad)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_max_stale_checks_must_be_a_count(bad):
  with pytest.raises(ValueError, match=r"trace_rule\.py.*max_stale_checks"):
    thor_optax.thor(0.1, max_stale_checks=bad)


def test_running_average_blends_the_blocks_the_rule_refreshes():
  """``ema_decay`` (the ``thor`` alias's default 0.95): a refreshed block inverts ``0.95 old +
  0.05 new``; a block the trace rule skips keeps its factor and inverse."""
  decay, lam = 0.95, 0.1
  tx = thor_optax.scale_by_thor(lam, block_size=B, trace_thresholds=(0.01, 0.0),
                                ema_decay=decay)
  a, g = _data(0)
  a2 = a.at[:, 4:8].multiply(3.0)   # only A's block 1 jumps
  states = _run_checks(tx, [_stats(a, g), _stats(a2, 0.5 * g)])
  spec = blocks.build_layout(_params(), B).layers[0]
  A1, A2 = np.asarray(a.T @ a / N, np.float64), np.asarray(a2.T @ a2 / N, np.float64)
  inverses = inverse_blocks(states[1])[spec.a.group][spec.a.start:spec.a.stop]
  damped = lambda F: np.linalg.inv(F + np.sqrt(lam) * np.eye(B))
  blend = decay * A1[4:8, 4:8] + (1 - decay) * A2[4:8, 4:8]
  np.testing.assert_allclose(inverses[1], damped(blend), rtol=2e-4, atol=1e-6)
  for i in (0, 2):  # not refreshed: the first check's factor
    np.testing.assert_allclose(inverses[i], damped(A1[4 * i:4 * i + 4, 4 * i:4 * i + 4]),
                               rtol=2e-4, atol=1e-6)
  # The whole G halves its scale, so every G block is refreshed and blended.
  G = np.asarray(g.T @ g / N, np.float64)
  G_blocks = inverse_blocks(states[1])[spec.g.group][spec.g.start:spec.g.stop]
  np.testing.assert_allclose(G_blocks[0], damped((decay + (1 - decay) * 0.25) * G[:4, :4]),
                             rtol=2e-4, atol=1e-6)
  # Without the average the refreshed block is the new batch's alone: the test can tell.
  assert np.abs(inverses[1] - damped(A2[4:8, 4:8])).max() > 1e-2


@pytest.mark.parametrize("ratio, averaged", [(None, True), (9.0, True), (8.0, False)])
def test_running_average_skips_blocks_with_enough_rows(ratio, averaged):
  """``ema_rows_ratio=k``: a block of ``b = 4`` dimensions formed from ``N = 32`` rows is
  averaged when ``32 < 4 k`` and takes the new batch's factor otherwise (``k = 8``: exactly
  ``k`` rows per dimension)."""
  lam = 0.1
  tx = thor_optax.scale_by_thor(lam, block_size=B, trace_thresholds=(0.0, 0.0),
                                ema_decay=0.5, ema_rows_ratio=ratio)
  a, g = _data(0)
  a2 = 2.0 * _data(1)[0]
  states = _run_checks(tx, [_stats(a, g), _stats(a2, g)])
  spec = blocks.build_layout(_params(), B).layers[0]
  A1, A2 = (np.asarray(x.T @ x / N, np.float64)[:4, :4] for x in (a, a2))
  want = 0.5 * A1 + 0.5 * A2 if averaged else A2
  got = inverse_blocks(states[1])[spec.a.group][spec.a.start]
  np.testing.assert_allclose(got, np.linalg.inv(want + np.sqrt(lam) * np.eye(B)), rtol=2e-4,
                             atol=1e-6)


def test_ema_rows_ratio_must_be_a_positive_number():
  for bad in (0.0, -1.0, float("inf"), jnp.asarray(4.0)):
    with pytest.raises(ValueError, match="ema_rows_ratio must be None or a positive"):
      thor_optax.scale_by_thor(ema_decay=0.9, ema_rows_ratio=bad)


def test_thor_alias_averages_the_blocks_by_default():
  """The alias keeps each stack's averaged factor blocks; ``ema_decay=None`` (the paper) none."""
  state = reference.kronecker_state(thor_optax.thor(0.1).init(_params()))
  assert state.blocks and all(stack["accumulator"].factor.shape == stack["inverse"].inverse.shape
                              for stack in state.blocks.values())
  paper = reference.kronecker_state(thor_optax.thor(0.1, ema_decay=None).init(_params()))
  assert not any("accumulator" in stack for stack in paper.blocks.values())


def _masked_update_case():
  """Blocks 1, 5 and 6 of 8 selected; ``fn`` fails on block 5; the sizes it was traced with."""
  old = jnp.arange(8.0, dtype=jnp.float32)[:, None] * jnp.ones((8, 3), jnp.float32)
  seen_sizes = []

  def fn(idx):
    seen_sizes.append(idx.shape[0])
    return -jnp.ones((idx.shape[0], 3), jnp.float32) * idx[:, None], idx != 5  # 5 "fails"

  mask = jnp.zeros(8, bool).at[jnp.array([1, 5, 6])].set(True)
  expected = np.array(old)
  expected[1], expected[6] = -1.0, -6.0
  return old, fn, mask, expected, seen_sizes


@pytest.mark.parametrize("form", ["budgeted", "sequential"])
def test_masked_block_update_only_selected_blocks(form):
  """Both forms replace exactly the selected blocks that ``fn`` accepts; the batched form traces
  one branch per non-zero budget, the sequential one a single block; nothing selected, nothing
  replaced."""
  old, fn, mask, expected, seen_sizes = _masked_update_case()
  update = {"budgeted": lambda m, o, f: blocks.budgeted_block_update(m, o, f, 4),
            "sequential": blocks.sequential_block_update}[form]
  new, refreshed = jax.jit(lambda m: update(m, old, fn))(mask)
  np.testing.assert_array_equal(refreshed, [0, 1, 0, 0, 0, 0, 1, 0])
  np.testing.assert_array_equal(new, expected)
  assert sorted(set(seen_sizes)) == ([2, 4, 6, 8] if form == "budgeted" else [1])
  assert blocks.refresh_budgets(8, 4) == (0, 2, 4, 6, 8)
  none, refreshed = jax.jit(lambda m: update(m, old, fn))(jnp.zeros(8, bool))
  np.testing.assert_array_equal(none, old)
  assert not refreshed.any()


def test_masked_block_update_on_cpu_is_sequential_unless_batched():
  """On CPU the step holds the sequential loop and none of the budgets' branches (a shorter
  compile); ``batched=True`` (``block_sharding``) keeps the budgets."""
  old, fn, mask, expected, _ = _masked_update_case()
  for batched in (False, True):
    step = jax.jit(lambda m, b=batched: blocks.masked_block_update(m, old, fn, 4, batched=b))
    new, _ = step(mask)
    np.testing.assert_array_equal(new, expected)
    hlo = step.lower(mask).as_text()
    budgets = [f"tensor<{k}x3xf32>" in hlo for k in (2, 4, 6)]  # fn's blocks per budget
    assert ("stablehlo.while" in hlo, "tensor<1x3xf32>" in hlo) == (not batched, not batched)
    assert budgets == [batched] * 3, (batched, budgets)


def test_platform_dependent_traces_only_the_cpu_branch_in_a_cpu_process():
  """In a CPU-only process ``linalg.platform_dependent`` traces the CPU branch alone (the
  inversion's batched branches cost a check step's first call tracing time), where
  ``jax.lax.platform_dependent`` traces both; either way the CPU branch is the one that runs."""
  traced = []

  def branch(name, shift):
    def fn(x):
      traced.append(name)
      return x + shift
    return fn

  cpu, default = branch("cpu", 2.0), branch("default", 1.0)
  out = jax.jit(lambda x: linalg.platform_dependent(x, cpu=cpu, default=default))(jnp.zeros(()))
  assert float(out) == 2.0 and traced == ["cpu"]
  traced.clear()
  out = jax.jit(lambda x: jax.lax.platform_dependent(x, cpu=cpu, default=default))(jnp.zeros(()))
  assert float(out) == 2.0 and sorted(traced) == ["cpu", "default"]


def test_diagnostics_per_layer_of_a_shared_block_stack():
  # Two layers whose blocks share one stack: each layer's diagnostics count its own blocks.
  params = {"first": {"kernel": jnp.zeros((D_IN, D_OUT), jnp.float32)},   # A 3 blocks, G 2
            "second": {"kernel": jnp.zeros((D_OUT, 8), jnp.float32)}}     # A 2 blocks, G 2
  (a1, g1), (a2, g2) = _data(0), _data(1)
  a2, g2 = a2[:, :D_OUT], jnp.concatenate([g2, g2[:, :2]], axis=1)

  def stats(a1, g1, a2, g2):
    return thor_optax.CurvatureStats(layers={
        "first": thor_optax.DenseStats(inputs=a1, cotangents=g1[None]),
        "second": thor_optax.DenseStats(inputs=a2, cotangents=g2[None])})

  tx = thor_optax.scale_by_thor(0.1, block_size=B, trace_thresholds=(0.01, 0.0))
  state = tx.init(params)
  update = jax.jit(lambda s, st: tx.update(params, s, params, curvature_stats=st)[1])
  first = update(state, stats(a1, g1, a2, g2))
  jump = a2.at[:, 0:4].multiply(3.0)  # the second layer's A block 0 jumps (trace x9)
  drop = g1.at[:, 4:6].multiply(0.5)  # the first layer's G block 1 drops (trace x0.25)
  second = update(first, stats(a1, drop, jump, g2))
  d1, d2 = second.diagnostics["first"], second.diagnostics["second"]
  assert (int(d1.blocks_refreshed), int(d2.blocks_refreshed)) == (1, 1)
  assert (int(d1.total_refreshes), int(d2.total_refreshes)) == (6, 5)
  assert int(d1.rejected_blocks) == int(d2.rejected_blocks) == 0
  t = float(jnp.sum(a2[:, 0:4] ** 2)) / N
  np.testing.assert_allclose(float(d2.trace_ratio), 8 * t / (t + 4 * np.sqrt(0.1)), rtol=1e-4)
  t = float(jnp.sum(g1[:, 4:6] ** 2)) / N  # two true dimensions in the padded block
  np.testing.assert_allclose(float(d1.trace_ratio), 0.75 * t / (t + 2 * np.sqrt(0.1)), rtol=1e-4)
  # An all-zero input batch: the first layer's 3 A blocks keep their inverses, counted.
  third = update(second, stats(jnp.zeros_like(a1), g1, a2, g2))
  assert (int(third.diagnostics["first"].rejected_blocks),
          int(third.diagnostics["second"].rejected_blocks)) == (3, 0)


def test_diagnostics_read_as_a_mapping_of_layer_records():
  # The record is three arrays over the layers, read per layer as LayerDiagnostics; a layer
  # without statistics at a check keeps its record; leading axes (pmap's) are kept.
  params = {"first": {"kernel": jnp.zeros((D_IN, D_OUT), jnp.float32)},
            "second": {"kernel": jnp.zeros((D_OUT, 8), jnp.float32)}}
  (a1, g1), (a2, g2) = _data(0), _data(1)
  tx = thor_optax.scale_by_thor(0.1, block_size=B, trace_thresholds=(0.0, 0.0))
  update = jax.jit(lambda s, st: tx.update(params, s, params, curvature_stats=st)[1])
  first = {"first": thor_optax.DenseStats(inputs=a1, cotangents=g1[None])}
  both = thor_optax.CurvatureStats(layers={**first, "second": thor_optax.DenseStats(
      inputs=a2[:, :D_OUT], cotangents=jnp.concatenate([g2, g2[:, :2]], axis=1)[None])})
  state = update(tx.init(params), both)
  with pytest.warns(UserWarning, match="second"):
    state = update(state, thor_optax.CurvatureStats(layers=first))
  diag = state.diagnostics
  assert isinstance(diag, thor_optax.Diagnostics) and list(diag) == ["first", "second"]
  assert len(jax.tree.leaves(diag)) == 3
  assert isinstance(diag["first"], thor_optax.LayerDiagnostics)
  # blocks_refreshed, num_blocks, total_refreshes, frozen_blocks, rejected_blocks
  records = {name: tuple(int(v) for v in d[:4] + d[5:]) for name, d in diag.items()}
  assert records == {"first": (5, 5, 10, 0, 0), "second": (4, 4, 4, 0, 0)}
  with pytest.raises(KeyError, match=r"'third'.*\['first', 'second'\]"):
    diag["third"]  # pylint: disable=pointless-statement
  stacked = jax.tree.map(lambda x: jnp.stack([x, 2 * x]), diag)
  np.testing.assert_array_equal(stacked["first"].total_refreshes, [10, 20])
  np.testing.assert_array_equal(stacked["second"].num_blocks, [4, 8])
