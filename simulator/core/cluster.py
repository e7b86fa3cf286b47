"""A cluster of identical replicas behind a request router (``SimConfig(replicas=R, router=...)``).

``round-robin`` and ``random`` decide every request's replica from its arrival order alone, so each replica is a
plain simulation of its share. ``least-loaded`` sends a request to the replica with the fewest outstanding requests
(assigned, not finished or rejected) at its arrival, so the replicas are simulated together in time order: before
a request is routed, every replica is advanced to its arrival time.
"""
from __future__ import annotations

import dataclasses
import time
from collections import Counter

import numpy as np
import pandas as pd

from lab.checks import entry_point
from lab.latency import latency_summary

from .engine import SimConfig, SimResult, SimulationError, Simulator, check_config
from .metrics import CLUSTER_RULES, combine_figure, format_rejections, parse_rejections
from .workloads import Workload

ROUTER_SEED = 1234  # the random router's stream (a run is deterministic)


def route(num_requests: int, replicas: int, router: str) -> list[list[int]]:
    """Each replica's requests for a router that does not look at load (``round-robin``, ``random``)."""
    if router == "round-robin":
        choice = np.arange(num_requests) % replicas
    else:
        choice = np.random.default_rng(ROUTER_SEED).integers(0, replicas, num_requests)
    return [np.flatnonzero(choice == r).tolist() for r in range(replicas)]


@entry_point
def run_simulation(workload: Workload, config: SimConfig, on_snapshot=None, snapshot_every: int = 50,
                   snapshot_pool: bool = True) -> SimResult:
    """One run of ``config`` on ``workload``: a ``Simulator`` for one replica, ``run_cluster`` for several."""
    check_config(config)  # before a cluster is built from it (replicas up to 4,096)
    if config.replicas > 1:
        return run_cluster(workload, config, on_snapshot, snapshot_every, snapshot_pool)
    return Simulator(workload, config, on_snapshot, snapshot_every, snapshot_pool).run()


def run_cluster(workload: Workload, config: SimConfig, on_snapshot=None, snapshot_every: int = 50,
                snapshot_pool: bool = True) -> SimResult:
    """Simulate ``config.replicas`` replicas of ``config`` on ``workload``; one cluster summary, per-replica rows
    (column ``replica``) in the timeseries and the per-request table. ``on_snapshot``, ``snapshot_every`` and
    ``snapshot_pool`` apply to each replica (see ``Simulator``)."""
    started = time.perf_counter()
    single = dataclasses.replace(config, replicas=1)
    if config.router == "least-loaded":
        sims = [Simulator(workload, single, on_snapshot, snapshot_every, snapshot_pool, requests=[])
                for _ in range(config.replicas)]
        for request, arrival in enumerate(workload.arrival_s):
            for sim in sims:
                sim.advance(float(arrival))
            min(sims, key=Simulator.outstanding).assign(request)  # ties: the lowest replica
        results = [_finish(sim, started) for sim in sims]
    else:
        shares = route(len(workload), config.replicas, config.router)
        results = [_finish(Simulator(workload, single, on_snapshot, snapshot_every, snapshot_pool, requests=share),
                           started) for share in shares]
    return combine(results, config, workload.n, time.perf_counter() - started)


def _finish(sim: Simulator, started: float) -> SimResult:
    sim.advance(float("inf"))
    return sim.finish_run(started)


def combine(results: list[SimResult], config: SimConfig, n: int, wall_time_s: float) -> SimResult:
    """One cluster result from its replicas' results: each summary figure combined by its rule in
    ``simulator.core.metrics.CLUSTER_RULES`` (sums, maxima, busy-time-weighted means, ratios of summed totals,
    latencies from the pooled requests); ``n``: the samples per request (kept for callers)."""
    summaries, totals = [r.summary for r in results], [r.totals for r in results]
    unruled = [key for key in summaries[0] if key not in CLUSTER_RULES]
    if unruled:
        raise SimulationError(f"summary figures {', '.join(unruled)} have no rule for combining replicas "
                              f"(simulator.core.metrics.CLUSTER_RULES)")
    requests = pd.concat([r.requests.assign(replica=i) for i, r in enumerate(results)]).sort_index()
    summary = {"allocator": config.allocator, "block_size": summaries[0]["block_size"],
               "kv_cache_dtype": config.kv_cache_dtype, "replicas": config.replicas, "router": config.router}
    for key in summaries[0]:
        value = combine_figure(key, summaries, totals)
        if value is not None:
            summary[key] = value
    summary.update(latency_summary(requests))
    summary["rejection_reasons"] = format_rejections(sum((Counter(parse_rejections(s["rejection_reasons"]))
                                                          for s in summaries), Counter()))
    makespan = summary["simulated_time_s"]
    summary.update(throughput_tok_s=summary["generated_tokens"] / makespan if makespan > 0 else 0.0,
                   throughput_req_s=summary["num_requests_completed"] / makespan if makespan > 0 else 0.0,
                   wall_time_s=wall_time_s)
    if "profile_extrapolation" in summaries[0]:
        summary["profile_extrapolation"] = "; ".join(dict.fromkeys(s["profile_extrapolation"] for s in summaries
                                                                  if s["profile_extrapolation"]))
    timeseries = pd.concat([r.timeseries.assign(replica=i) for i, r in enumerate(results)], ignore_index=True)
    steps = None
    if results[0].steps is not None:
        steps = pd.concat([r.steps.assign(replica=i) for i, r in enumerate(results)], ignore_index=True)
    combined = {key: sum(total.get(key, 0) for total in totals) for key in totals[0]}
    return SimResult(summary, timeseries, requests, config, steps, combined)
