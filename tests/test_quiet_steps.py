"""The simulator's quiet steps (``Simulator._skip_quiet``): running stretches of plain decode steps at once gives
the same results, bit for bit, as planning every step."""
import math

import pytest

import simulator.core.engine as engine_module
from lab.sched.scheduler import Scheduler
from simulator import ALLOCATORS, default_inputs, make_workload, run_simulation
from simulator.core.engine import SimConfig


def run(workload, config, fast: bool, monkeypatch, **options):
    """The result with the fast path on or off, and how many steps it skipped."""
    skipped = []
    original = Scheduler.skip_quiet_steps
    monkeypatch.setattr(engine_module, "FAST_FORWARD", fast)
    monkeypatch.setattr(Scheduler, "skip_quiet_steps",
                        lambda self, steps, count: skipped.append(steps) or original(self, steps, count))
    return run_simulation(workload, config, **options), sum(skipped)


def assert_identical(planned, skipped) -> None:
    for key, value in planned.summary.items():
        if key == "wall_time_s":
            continue
        other = skipped.summary[key]
        assert value == other or (isinstance(value, float) and math.isnan(value) and math.isnan(other)), key
    assert planned.timeseries.equals(skipped.timeseries)
    assert planned.requests.equals(skipped.requests)


@pytest.mark.parametrize("allocator", list(ALLOCATORS))
@pytest.mark.parametrize("scheduling", ["prefill-first", "chunked", "vllm"])
def test_quiet_steps_change_nothing(allocator, scheduling, monkeypatch):
    """Every allocator and scheduling mode on a loaded pool (preemptions, a blocked queue head, prefix hits on the
    paged pool), with few timeseries points (rows are kept inside quiet stretches and thinned as usual)."""
    workload = make_workload("sharegpt", num_requests=300, rate=8.0, max_model_len=1024, seed=3)
    config = SimConfig(allocator=allocator, block_size=16, capacity_tokens=12_000, max_model_len=1024,
                       scheduling=scheduling, max_points=60)
    planned, none = run(workload, config, False, monkeypatch)
    fast, skipped = run(workload, config, True, monkeypatch)
    assert none == 0 and skipped > planned.summary["iterations"] // 10  # the fast path ran, often
    assert_identical(planned, fast)


@pytest.mark.parametrize("block_size", [1, 3, 256])
def test_quiet_steps_at_any_block_size(block_size, monkeypatch):
    """Block sizes whose block reservations come every step (1) or seldom (256: whole stretches with no sequence
    needing a block, where the fast path must stop at the next finish, not scan ahead)."""
    workload = make_workload("sharegpt", num_requests=200, rate=6.0, max_model_len=1024, seed=4)
    config = SimConfig(allocator="paged", block_size=block_size, capacity_tokens=20_000, max_model_len=1024)
    planned, _ = run(workload, config, False, monkeypatch)
    fast, skipped = run(workload, config, True, monkeypatch)
    assert_identical(planned, fast)
    assert skipped > 0 or block_size == 1


def test_quiet_steps_stop_at_snapshots_and_clusters_agree(monkeypatch):
    """Snapshots (the page's progress) land on the same steps with the same contents; a cluster's replicas, advanced
    by the router's clock, agree too."""
    workload = make_workload("sharegpt", num_requests=200, rate=20.0, max_model_len=1024, seed=5)
    seen = {}
    for fast in (False, True):
        snapshots = []
        config = SimConfig(allocator="contiguous-max", capacity_tokens=10_000, max_model_len=1024)
        result, _ = run(workload, config, fast, monkeypatch, snapshot_every=37,
                        on_snapshot=lambda snap: snapshots.append((snap.iteration, snap.time_s, snap.metrics,
                                                                   snap.regions)))
        cluster, _ = run(workload, SimConfig(allocator="contiguous-pow2", capacity_tokens=6_000, max_model_len=1024,
                                             replicas=3, router="least-loaded"), fast, monkeypatch)
        seen[fast] = result, snapshots, cluster
    assert_identical(seen[False][0], seen[True][0])
    assert seen[False][1] == seen[True][1] and len(seen[True][1]) > 10
    assert_identical(seen[False][2], seen[True][2])


def test_the_default_comparison_is_unchanged(monkeypatch):
    """The Memory simulator's opening comparison (every allocator at the app's defaults): the same summary numbers
    with and without the fast path."""
    workload, configs = default_inputs(400)
    for config in configs:
        assert_identical(run(workload, config, False, monkeypatch)[0], run(workload, config, True, monkeypatch)[0])
