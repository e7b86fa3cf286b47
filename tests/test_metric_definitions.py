"""Numbers defined once and right by definition (issue 70): a cluster's figures combine its replicas' by one rule
table (a peak is the highest replica's, a hit rate is hits over lookups of all replicas, latencies come from the
pooled requests), and a request's TTFT / TPOT / E2E are ``lab.latency``'s whichever caller asks (n > 1: the
longest sample's tokens count)."""
import dataclasses

import numpy as np
import pytest

from lab.engine.llm_engine import RequestOutput, request_table
from lab.latency import counted_tokens, latencies_of
from simulator import SimConfig, Simulator
from simulator.core.cluster import combine, route, run_simulation
from simulator.core.engine import SimulationError
from simulator.core.metrics import BUSY_MEAN, CLUSTER_RULES, RATIOS
from simulator.core.workloads import SyntheticSpec, Workload, synthetic_workload

WORKLOAD = synthetic_workload(SyntheticSpec(num_requests=90, rate=20.0, seed=5, shared_prefix_tokens=64))
CONFIG = SimConfig(capacity_tokens=9_000, replicas=2, router="random", kv_offload_blocks=40)


@pytest.fixture(scope="module")
def cluster_and_shares():
    cluster = run_simulation(WORKLOAD, CONFIG)
    single = dataclasses.replace(CONFIG, replicas=1)
    alone = [Simulator(WORKLOAD.subset(share), single).run() for share in route(len(WORKLOAD), 2, "random")]
    return cluster, alone


def test_cluster_peak_is_the_highest_replica_s(cluster_and_shares):
    cluster, alone = cluster_and_shares
    peaks = [run.summary["peak_allocated_frac"] for run in alone]
    assert peaks[0] != pytest.approx(peaks[1])  # so that a mean of the peaks would be below the highest
    assert cluster.summary["peak_allocated_frac"] == max(peaks)
    assert cluster.summary["peak_batch_size"] == max(run.summary["peak_batch_size"] for run in alone)


def test_cluster_rates_are_totals_over_totals_not_means_of_rates(cluster_and_shares):
    cluster, alone = cluster_and_shares
    for rate, (hits, queried) in RATIOS.items():
        expected = sum(run.totals[hits] for run in alone) / sum(run.totals[queried] for run in alone)
        assert cluster.summary[rate] == pytest.approx(expected, rel=1e-12), rate
    rates = [run.summary["prefix_cache_hit_rate"] for run in alone]
    assert rates[0] != pytest.approx(rates[1])  # the shares differ, so a mean of rates would be wrong here
    assert cluster.summary["prefix_cache_hit_rate"] != pytest.approx(np.mean(rates))
    assert cluster.summary["prefix_cache_hit_blocks"] == sum(run.summary["prefix_cache_hit_blocks"] for run in alone)


def test_cluster_means_weigh_replicas_by_busy_time_and_latencies_pool_requests(cluster_and_shares):
    cluster, alone = cluster_and_shares
    busy = [run.totals["busy_s"] for run in alone]
    for key in (k for k, rule in CLUSTER_RULES.items() if rule == BUSY_MEAN):
        expected = np.average([run.summary[key] for run in alone], weights=busy)
        assert cluster.summary[key] == pytest.approx(expected, rel=1e-12), key
    pooled = np.concatenate([latencies_of(run.requests)["tpot_s"].to_numpy() for run in alone])
    assert cluster.summary["tpot_p90_s"] == pytest.approx(np.percentile(pooled, 90), rel=1e-12)


def test_a_summary_figure_without_a_rule_is_refused(cluster_and_shares):
    _, alone = cluster_and_shares
    alone[0].summary["new_metric"] = 1.0
    try:
        with pytest.raises(SimulationError, match="new_metric"):
            combine(alone, CONFIG, 1, 0.0)
    finally:
        del alone[0].summary["new_metric"]


def test_every_figure_of_a_rich_run_has_a_rule(cluster_and_shares):
    cluster, alone = cluster_and_shares
    assert set(alone[0].summary) <= set(CLUSTER_RULES)
    assert set(cluster.summary) <= set(CLUSTER_RULES)


def test_counted_tokens_is_the_longest_sample_s():
    assert counted_tokens(np.array([[3, 9], [5, 2]])).tolist() == [9, 5]
    assert counted_tokens([[3, 9], [4]]).tolist() == [9, 4]
    assert counted_tokens(np.array([7, 1])).tolist() == [7, 1]


def test_n_greater_than_one_gives_the_same_tpot_through_the_engine_and_the_simulator():
    """The same requests (two samples each, of different lengths) through the simulator's summary and the engine's
    request table: the same TPOT, the longest sample's tokens counted (the simulator divided by the first sample's,
    the engine by the longest's: 0.039 against 0.015 s in the issue)."""
    samples = np.array([[3, 9], [5, 2], [4, 12]])
    workload = Workload("n2", np.array([0.0, 0.0, 0.01]), np.array([40, 40, 40]), samples[:, 0], n=2,
                        sample_output_tokens=samples).check()
    result = Simulator(workload, SimConfig(capacity_tokens=4_096)).run()
    requests = result.requests
    outputs = [RequestOutput(i, [1] * 40, [[7] * int(length) for length in samples[i]], None, row.arrival_s,
                             row.first_token_s, row.finish_s) for i, row in enumerate(requests.itertuples())]
    engine = request_table(outputs)
    longest = samples.max(axis=1)
    expected = (requests["finish_s"] - requests["first_token_s"]).to_numpy() / (longest - 1)
    np.testing.assert_allclose(engine["tpot_s"].to_numpy(), expected, rtol=1e-12)
    for q in (50, 90, 99):
        assert result.summary[f"tpot_p{q}_s"] == pytest.approx(np.percentile(engine["tpot_s"], q), rel=1e-12)
        assert result.summary[f"ttft_p{q}_s"] == pytest.approx(np.percentile(engine["ttft_s"], q), rel=1e-12)
        assert result.summary[f"e2e_p{q}_s"] == pytest.approx(np.percentile(engine["e2e_s"], q), rel=1e-12)
    assert engine["output_tokens"].tolist() == samples.sum(axis=1).tolist()  # every sample's tokens generated
