"""KV memory categories over time, their time-weighted means, and request latency percentiles.

Every sample splits the whole KV capacity (token slots) into five categories that sum to it:
``token_states`` (slots holding a token's KV now), ``reserved`` (allocated slots the owner will fill later),
``internal_fragmentation`` (allocated slots the owner will never fill), ``external_fragmentation`` (free slots
outside the largest free contiguous region; zero for paged) and ``free`` (the largest free region; for paged, all
free blocks).
"""
from __future__ import annotations

import numpy as np
import pandas as pd

CATEGORIES = ("token_states", "reserved", "internal_fragmentation", "external_fragmentation", "free")
COLUMNS = ("iteration", "time_s", *CATEGORIES, "running", "waiting", "blocks_in_use", "preemptions",
           "generated_tokens", "prefix_cache_hits", "batch_tokens")
SUMMARY_FRACTIONS = {"token_states": "token_states_frac", "reserved": "reserved_frac",
                     "internal_fragmentation": "internal_frag_frac", "external_fragmentation": "external_frag_frac",
                     "free": "free_frac"}


class MetricsRecorder:
    """Accumulates time-weighted category totals every iteration and keeps at most ``2 * max_points`` timeseries
    rows, halving them (every other row) and doubling the stride when full."""

    def __init__(self, capacity: int, max_points: int):
        self.capacity = capacity
        self.max_points = max_points
        self.stride = 1
        self.rows: list[tuple] = []
        self.weighted = [0.0] * len(CATEGORIES)
        self.total_time = 0.0
        self.batch_time = 0.0
        self.peak_batch = 0
        self.peak_allocated = 0

    def accumulate(self, sim, duration: float) -> None:
        """Weight the current state by the iteration's duration; record a timeseries row every ``stride``."""
        values = sim.policy.categories(sim.held_tokens())
        weighted = self.weighted
        weighted[0] += values[0] * duration
        weighted[1] += values[1] * duration
        weighted[2] += values[2] * duration
        weighted[3] += values[3] * duration
        weighted[4] += values[4] * duration
        batch = len(sim.running)
        self.total_time += duration
        self.batch_time += batch * duration
        if batch > self.peak_batch:
            self.peak_batch = batch
        allocated = self.capacity - values[3] - values[4]
        if allocated > self.peak_allocated:
            self.peak_allocated = allocated
        if sim.iteration % self.stride == 0:
            self.rows.append(self._row(sim, values))
            if len(self.rows) >= 2 * self.max_points:
                self.rows = self.rows[::2]
                self.stride *= 2

    def _row(self, sim, values) -> tuple:
        policy, paged = sim.policy, sim.policy_is_paged
        blocks = policy.manager.num_used_blocks if paged else np.nan
        hits = policy.manager.prefix_cache_stats.hit_blocks if paged else 0
        return (sim.iteration, sim.time, *values, len(sim.running), sim.scheduler.num_waiting_seqs, blocks,
                sim.num_preemptions, sim.generated_tokens, hits, len(sim.running) + len(sim.prefilling))

    def current(self, sim) -> dict:
        """The latest state as a dict of ``COLUMNS``."""
        return dict(zip(COLUMNS, self._row(sim, sim.policy.categories(sim.held_tokens()))))

    def summary(self) -> dict:
        """Time-weighted mean fraction of capacity of each category, mean and peak batch size."""
        total = self.total_time or 1.0
        out = {SUMMARY_FRACTIONS[name]: self.weighted[i] / total / self.capacity for i, name in enumerate(CATEGORIES)}
        if self.total_time == 0:  # nothing ever ran (e.g. every request rejected): the pool stayed free
            out["free_frac"] = 1.0
        out.update(mean_batch_size=self.batch_time / total, peak_batch_size=self.peak_batch,
                   peak_allocated_frac=self.peak_allocated / self.capacity)
        return out

    def timeseries(self) -> pd.DataFrame:
        frame = pd.DataFrame(self.rows, columns=list(COLUMNS))
        for name in CATEGORIES:
            frame[f"{name}_frac"] = frame[name] / self.capacity
        return frame


def latency_summary(requests: pd.DataFrame, n: int = 1) -> dict:
    """TTFT, TPOT and end-to-end latency p50/p90/p99 (seconds) over completed requests, and the normalized
    latency (mean seconds per output token)."""
    done = requests[requests["finish_s"].notna()]
    ttft = (done["first_token_s"] - done["arrival_s"]).to_numpy()
    e2e = (done["finish_s"] - done["arrival_s"]).to_numpy()
    steps = np.maximum(done["output_tokens"].to_numpy() - 1, 1)
    tpot = (done["finish_s"] - done["first_token_s"]).to_numpy() / steps
    out = {}
    for name, values in (("ttft", ttft), ("tpot", tpot), ("e2e", e2e)):
        for q in (50, 90, 99):
            out[f"{name}_p{q}_s"] = float(np.percentile(values, q)) if len(values) else np.nan
    # the vLLM paper's normalized latency: mean over requests of end-to-end latency / output tokens
    out["normalized_latency_s"] = float(np.mean(e2e / np.maximum(done["output_tokens"].to_numpy(), 1))) \
        if len(e2e) else np.nan
    return out
