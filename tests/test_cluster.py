"""A cluster of replicas behind a router: one replica is the plain simulator, round-robin replicas are plain runs
on their shares, least-loaded balances outstanding requests."""
import dataclasses

import numpy as np
import pandas as pd
import pytest

from simulator import SimConfig, Simulator
from simulator.core.cluster import route, run_simulation
from simulator.core.workloads import SyntheticSpec, synthetic_workload

WORKLOAD = synthetic_workload(SyntheticSpec(num_requests=240, rate=30.0, seed=3))
CONFIG = SimConfig(capacity_tokens=12_000, max_points=100_000)


def strip(summary):
    return {k: v for k, v in summary.items() if k not in ("wall_time_s", "replicas", "router")}


@pytest.mark.parametrize("router", ["round-robin", "least-loaded", "random"])
def test_one_replica_is_the_plain_simulator(router):
    plain = Simulator(WORKLOAD, CONFIG).run()
    from simulator.core.cluster import run_cluster
    cluster = run_cluster(WORKLOAD, dataclasses.replace(CONFIG, router=router))
    for key, value in strip(plain.summary).items():
        assert cluster.summary[key] == pytest.approx(value, nan_ok=True), key
    pd.testing.assert_frame_equal(cluster.timeseries.drop(columns="replica"), plain.timeseries)


def test_round_robin_replicas_equal_plain_runs_on_their_shares():
    result = run_simulation(WORKLOAD, dataclasses.replace(CONFIG, replicas=3))
    shares = route(len(WORKLOAD), 3, "round-robin")
    finished = 0
    for replica, share in enumerate(shares):
        alone = Simulator(WORKLOAD.subset(share), CONFIG).run()
        mine = result.requests[result.requests["replica"] == replica]
        np.testing.assert_array_equal(mine["finish_s"].to_numpy(), alone.requests["finish_s"].to_numpy())
        rows = result.timeseries[result.timeseries["replica"] == replica].drop(columns="replica")
        pd.testing.assert_frame_equal(rows.reset_index(drop=True), alone.timeseries)
        finished += alone.summary["num_requests_completed"]
    assert result.summary["num_requests_completed"] == finished == len(WORKLOAD)
    assert result.summary["simulated_time_s"] == max(result.requests["finish_s"])


def test_least_loaded_balances_and_beats_random_on_tail_latency():
    busy = synthetic_workload(SyntheticSpec(num_requests=400, rate=60.0, seed=5))
    config = dataclasses.replace(CONFIG, replicas=4)
    least = run_simulation(busy, dataclasses.replace(config, router="least-loaded"))
    rand = run_simulation(busy, dataclasses.replace(config, router="random"))
    counts = least.requests["replica"].value_counts()
    assert len(counts) == 4 and counts.max() - counts.min() < 0.2 * counts.mean()
    assert least.summary["num_requests_completed"] == rand.summary["num_requests_completed"] == 400
    assert least.summary["e2e_p90_s"] < rand.summary["e2e_p90_s"]


def test_more_replicas_serve_faster():
    one = Simulator(WORKLOAD, CONFIG).run().summary
    four = run_simulation(WORKLOAD, dataclasses.replace(CONFIG, replicas=4)).summary
    assert four["ttft_p90_s"] < one["ttft_p90_s"] and four["capacity_tokens"] == 4 * one["capacity_tokens"]


@pytest.mark.parametrize("settings", [dict(replicas=0), dict(replicas=2.0), dict(router="fastest")])
def test_bad_cluster_settings(settings):
    with pytest.raises(ValueError, match="replicas|router"):
        Simulator(WORKLOAD, dataclasses.replace(CONFIG, **settings))


@pytest.mark.parametrize("router", ["least-loaded", "round-robin"])
def test_progress_only_callers_never_copy_a_replica_s_pool(router, monkeypatch):
    """``compare`` asks for progress only; each replica copied its whole pool every 100 steps all the same (10,000
    requests on 8 replicas: 13 s, 12 of them in those copies)."""
    import lab.sched.kv_policy
    from simulator import compare

    copies = []
    monkeypatch.setattr(lab.sched.kv_policy, "pool_snapshot", lambda manager: copies.append(manager) or pytest.fail("copied"))
    fractions = []
    summary, _ = compare(synthetic_workload(SyntheticSpec(preset="sharegpt", num_requests=400, rate=50.0)),
                         [SimConfig(allocator="paged", replicas=3, router=router)], progress=fractions.append)
    assert summary["num_requests_completed"].iloc[0] == 400 and fractions and not copies
