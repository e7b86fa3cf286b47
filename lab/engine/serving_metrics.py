"""A runtime run's metrics under vLLM's names (``vllm:kv_cache_usage_perc``, ``vllm:num_requests_running`` …,
https://docs.vllm.ai/en/latest/usage/metrics.html), for the runtime page's panels: the gauges over time, the latency
histograms' samples (``lab.report.charts`` bins and draws them), and each request's queue / prefill / decode phases."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

# vLLM's gauge and counter names -> this run's step-table column (fractions stay fractions; the page shows %)
GAUGES = {"vllm:kv_cache_usage_perc": "kv_cache_usage", "vllm:num_requests_running": "num_running",
          "vllm:num_requests_waiting": "num_waiting", "vllm:num_requests_swapped": "num_swapped",
          "vllm:prefix_cache_hit_rate": "prefix_cache_hit_rate", "vllm:num_preemptions_total": "num_preemptions_total"}
# vLLM's histogram names -> what they hold (seconds)
HISTOGRAMS = {"vllm:time_to_first_token_seconds": "time to first token",
              "vllm:inter_token_latency_seconds": "inter-token latency",
              "vllm:e2e_request_latency_seconds": "end-to-end request latency"}
PHASES = ("queue", "prefill", "decode")


@dataclass(slots=True)
class ServingMetrics:
    """``gauges``: per step, ``t_s`` (seconds since the run started) and the ``GAUGES`` columns; ``latencies``: one
    array of seconds per ``HISTOGRAMS`` name (inter-token latency: every gap between two tokens of a sequence);
    ``timeline``: one row per request and phase (request_id, phase, start_s, end_s)."""

    gauges: pd.DataFrame
    latencies: dict
    timeline: pd.DataFrame


def serving_metrics(run) -> ServingMetrics:
    """The metrics of a ``lab.engine.live.RuntimeRun`` (``run_runtime``'s or ``run_runtime_detached``'s)."""
    steps = run.steps
    gauges = pd.DataFrame({"t_s": steps["elapsed_s"] if len(steps) else []})
    for name, column in GAUGES.items():
        gauges[name] = steps[column].to_numpy() if column in steps else np.zeros(len(gauges))
    tokens = run.tokens
    itl = (np.concatenate([np.diff(np.sort(group.to_numpy())) for _, group in tokens.groupby("seq_id")["t_s"]])
           if len(tokens) else np.array([]))
    requests = run.requests
    latencies = {"vllm:time_to_first_token_seconds": requests["ttft_s"].dropna().to_numpy(),
                 "vllm:inter_token_latency_seconds": itl,
                 "vllm:e2e_request_latency_seconds": requests["e2e_s"].dropna().to_numpy()}
    return ServingMetrics(gauges, latencies, request_timeline(requests))


def request_timeline(requests: pd.DataFrame) -> pd.DataFrame:
    """Each request's phases: queue (arrival to its prompt's first chunk), prefill (to its first token), decode (to
    its last), in seconds since the run started; a request without the times has no rows."""
    rows = []
    if {"arrival_s", "scheduled_s", "first_token_s", "finish_s"} <= set(requests):
        for row in requests.itertuples():
            edges = (row.arrival_s, row.scheduled_s, row.first_token_s, row.finish_s)
            if any(map(math.isnan, edges)):
                continue
            rows += [(row.request_id, phase, start, end) for phase, start, end in zip(PHASES, edges, edges[1:])]
    return pd.DataFrame(rows, columns=["request_id", "phase", "start_s", "end_s"])
