"""KV memory categories over time, their time-weighted means, and request latency percentiles (``latency_summary``:
the one definition in ``lab.latency``, which the engine's run metrics call too).

Every sample splits the whole KV capacity (token slots) into five categories that sum to it:
``token_states`` (slots holding a token's KV now), ``reserved`` (allocated slots the owner will fill later),
``internal_fragmentation`` (allocated slots the owner will never fill), ``external_fragmentation`` (free slots
outside the largest free contiguous region; zero for paged) and ``free`` (the largest free region; for paged, all
free blocks).
"""
from __future__ import annotations

import math
from dataclasses import fields
from itertools import repeat
from operator import attrgetter

import numpy as np
import pandas as pd

from lab.latency import PERCENTILES, SUMMARIZED
from lab.sched.scheduler import MemorySample, StepStats

CATEGORIES = ("token_states", "reserved", "internal_fragmentation", "external_fragmentation", "free")
# A timeseries row is the step's ``StepStats`` (what the engine reports too), then the memory categories and the
# running totals of preemptions and prefix-cache hits.
STEP_FIELDS = tuple(f.name for f in fields(StepStats))
COLUMNS = (*STEP_FIELDS, *CATEGORIES, "preemptions", "prefix_cache_hits")
_step_fields = attrgetter(*STEP_FIELDS)
SUMMARY_FRACTIONS = {name: f"{name}_frac" for name in CATEGORIES}  # the summary's time-weighted mean of each
CATEGORY_LABELS = {"token_states": "Holding tokens", "reserved": "Reserved (filled later)",
                   "internal_fragmentation": "Internal fragmentation", "external_fragmentation": "External fragmentation",
                   "free": "Free"}


class MetricsRecorder:
    """Accumulates time-weighted category totals every iteration (``accumulate``) and keeps at most
    ``2 * max_points`` timeseries rows (``record`` when ``due``), halving them (every other row) and doubling the
    stride when full."""

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
        self.allocated_time = self.unshared_time = 0.0

    def accumulate(self, values: MemorySample, batch: int, duration: float) -> None:
        """Weight ``values`` (a policy's ``memory_sample``: the categories, then the slots the sequences would hold
        without sharing) and the batch size (the running sequences, partly prefilled ones included) held during an
        iteration by its duration."""
        weighted = self.weighted
        weighted[0] += values.token_states * duration
        weighted[1] += values.reserved * duration
        weighted[2] += values.internal_fragmentation * duration
        weighted[3] += values.external_fragmentation * duration
        weighted[4] += values.free * duration
        self.total_time += duration
        self.batch_time += batch * duration
        if batch > self.peak_batch:
            self.peak_batch = batch
        allocated = self.capacity - values.external_fragmentation - values.free
        self.allocated_time += allocated * duration
        self.unshared_time += values.table_slots * duration
        if allocated > self.peak_allocated:
            self.peak_allocated = allocated

    def accumulate_run(self, first: MemorySample, grow: int, batch: int, durations: list[float],
                       taken: list[int] | None = None, settled: list[int] | None = None) -> None:
        """``accumulate`` over consecutive steps of one batch that frees no memory (the simulator's quiet steps), in
        the same order and with the same arithmetic as one call per step: step ``i``'s sample is ``first`` with
        ``i * grow`` more token states and as many fewer reserved slots (each sequence holds one more token) and,
        with ``taken`` and ``settled`` (paged), ``taken[i]`` slots moved from free to reserved (blocks reserved
        since ``first``) and ``settled[i]`` from reserved to internal fragmentation (never filled)."""
        w0, w1, w2, w3, w4 = self.weighted
        tokens, reserved, internal = first.token_states, first.reserved, first.internal_fragmentation
        external, free, table = first.external_fragmentation, first.free, first.table_slots
        allocated = self.capacity - external - free
        total, batch_time, allocated_time, unshared_time = (self.total_time, self.batch_time, self.allocated_time,
                                                            self.unshared_time)
        extra = never = 0
        steps = zip(durations, taken, settled) if taken is not None else \
            zip(durations, repeat(0), repeat(0))
        for duration, extra, never in steps:
            w0 += tokens * duration
            w1 += (reserved + extra - never) * duration
            w2 += (internal + never) * duration
            w3 += external * duration
            w4 += (free - extra) * duration
            total += duration
            batch_time += batch * duration
            allocated_time += (allocated + extra) * duration
            unshared_time += (table + extra) * duration
            tokens += grow
            reserved -= grow
        self.weighted[:] = w0, w1, w2, w3, w4
        self.total_time, self.batch_time, self.allocated_time, self.unshared_time = (total, batch_time,
                                                                                     allocated_time, unshared_time)
        if durations:
            self.peak_batch = max(self.peak_batch, batch)
            self.peak_allocated = max(self.peak_allocated, allocated + extra)

    def due(self, step: int) -> bool:
        """Whether step ``step`` gets a timeseries row."""
        return step % self.stride == 0

    def record(self, stats: StepStats, categories: tuple, preemptions: int, prefix_cache_hits: int) -> None:
        """Append the row of a step (its ``StepStats`` and the categories after it, ``MemorySample.categories``)."""
        self.append(row(stats, categories, preemptions, prefix_cache_hits))

    def append(self, values: tuple) -> None:
        """Append a row (``COLUMNS``), halving the rows and doubling the stride when full."""
        self.rows.append(values)
        if len(self.rows) >= 2 * self.max_points:
            self.rows = self.rows[::2]
            self.stride *= 2

    def summary(self) -> dict:
        """Time-weighted mean fraction of capacity of each category, mean and peak batch size."""
        total = self.total_time or 1.0
        out = {SUMMARY_FRACTIONS[name]: self.weighted[i] / total / self.capacity for i, name in enumerate(CATEGORIES)}
        if self.total_time == 0:  # nothing ever ran (e.g. every request rejected): the pool stayed free
            out["free_frac"] = 1.0
        out.update(mean_batch_size=self.batch_time / total, peak_batch_size=self.peak_batch,
                   peak_allocated_frac=self.peak_allocated / self.capacity,
                   sharing_saving_frac=1 - self.allocated_time / self.unshared_time if self.unshared_time else 0.0)
        return out

    def totals(self) -> dict:
        """The additive quantities behind ``summary``'s means and ratios (``RATIOS``, ``BUSY_MEAN``): what a cluster
        sums over its replicas before dividing."""
        return {"busy_s": self.total_time, "unshared_token_s": self.unshared_time,
                "shared_saved_token_s": self.unshared_time - self.allocated_time}

    def timeseries(self) -> pd.DataFrame:
        """The kept rows (``COLUMNS``) and each category's fraction of the capacity (``<category>_frac``)."""
        if not self.rows:
            return pd.DataFrame(columns=[*COLUMNS, *(f"{name}_frac" for name in CATEGORIES)])
        columns = dict(zip(COLUMNS, map(np.array, zip(*self.rows))))
        for name in CATEGORIES:
            columns[f"{name}_frac"] = columns[name] / self.capacity
        return pd.DataFrame(columns)


def row(stats: StepStats, categories: tuple, preemptions: int, prefix_cache_hits: int) -> tuple:
    """A timeseries row (``COLUMNS``)."""
    return (*_step_fields(stats), *categories, preemptions, prefix_cache_hits)


_STEP, _DURATION, _ELAPSED, _GENERATED, _BLOCKS_IN_USE, _FREE_BLOCKS = map(STEP_FIELDS.index, (
    "step", "duration_s", "elapsed_s", "generated_tokens", "blocks_in_use", "num_free_blocks"))
_CATEGORY_COLUMNS = slice(len(STEP_FIELDS), len(STEP_FIELDS) + len(CATEGORIES))


def quiet_row(first: tuple, ahead: int, duration_s: float, elapsed_s: float, generated_tokens: int,
              categories: tuple, blocks_taken: int = 0) -> tuple:
    """The row of the ``ahead``-th (from 0) of a run of quiet steps from the row the first would have before its
    blocks are reserved (``first``): the same but for the step, its duration, the clock, the tokens so far, the
    categories and the ``blocks_taken`` since (a quiet step changes nothing else; a row edited, not a ``StepStats``
    built per row)."""
    values = list(first)
    values[_STEP] += ahead
    values[_BLOCKS_IN_USE] += blocks_taken
    values[_FREE_BLOCKS] -= blocks_taken
    values[_DURATION], values[_ELAPSED], values[_GENERATED] = duration_s, elapsed_s, generated_tokens
    values[_CATEGORY_COLUMNS] = categories
    return tuple(values)


REJECTION_REASONS = {"max_model_len": "longer than max_model_len (prompt + output)",
                     "capacity": "larger than the whole KV pool", "n": "more samples than max_num_seqs"}
REJECTION_REMEDIES = {"max_model_len": "raise max_model_len", "capacity": "give the KV pool more memory",
                      "n": "raise max_num_seqs"}


def format_rejections(counts: dict[str, int]) -> str:
    """A summary's ``rejection_reasons``: ``reason=count`` joined by ``;``, reasons sorted (``""``: none)."""
    return ";".join(f"{reason}={count}" for reason, count in sorted(counts.items()))


def parse_rejections(text: str) -> dict[str, int]:
    """``format_rejections`` read back."""
    return {reason: int(count) for reason, count in (part.split("=") for part in filter(None, text.split(";")))}


def rejection_warning(row) -> str:
    """The sentence a CLI or page shows for a summary row (``allocator``, ``num_requests``, ``num_requests_rejected``,
    ``rejection_reasons``) with rejected requests."""
    counts = parse_rejections(row.rejection_reasons).items()
    why = ", ".join(f"{count} {REJECTION_REASONS.get(reason, reason)}" for reason, count in counts)
    remedies = " or ".join(REJECTION_REMEDIES[reason] for reason, _ in counts if reason in REJECTION_REMEDIES)
    return (f"{row.allocator}: {row.num_requests_rejected} of {row.num_requests} requests were rejected ({why}): they "
            f"can never run in this configuration" + (f"; to run them, {remedies}" if remedies else ""))


# How each figure of one replica's summary becomes a cluster's (``simulator.core.cluster.combine``): the one table
# it reads. A figure missing here stops the combination (``SimulationError``), so a new figure must say how it adds
# up across replicas instead of falling into an average that is wrong by definition.
SAME, SUM, MAX, ANY = "same", "sum", "max", "any"
BUSY_MEAN = "busy-time-weighted mean"  # a time-weighted mean: weighted by each replica's busy time (totals' busy_s)
RATIO = "ratio of totals"  # sum of the numerators over sum of the denominators (``RATIOS``), never a mean of rates
POOLED = "from the pooled requests"  # percentiles and means over every replica's requests together (lab.latency)
OWN = "the cluster's own"  # computed from the combined figures (throughputs, the makespan's), merged (rejections)
RATIOS = {"prefix_cache_hit_rate": ("prefix_cache_hit_blocks", "prefix_cache_queried_blocks"),
          "offload_hit_rate": ("offload_hit_blocks", "prefix_cache_queried_blocks"),
          "sharing_saving_frac": ("shared_saved_token_s", "unshared_token_s")}
CLUSTER_RULES = {
    "allocator": SAME, "block_size": SAME, "kv_cache_dtype": SAME, "replicas": OWN, "router": OWN,
    **{fraction: BUSY_MEAN for fraction in SUMMARY_FRACTIONS.values()}, "mean_batch_size": BUSY_MEAN,
    "peak_batch_size": MAX, "peak_allocated_frac": MAX, "host_tier_peak_blocks": MAX, "simulated_time_s": MAX,
    "sharing_saving_frac": RATIO, "prefix_cache_hit_rate": RATIO, "offload_hit_rate": RATIO,
    **{f"{name}_p{q}_s": POOLED for name in SUMMARIZED for q in PERCENTILES},
    "normalized_latency_s": POOLED,
    **{count: SUM for count in ("capacity_tokens", "host_capacity_tokens", "kv_capacity_gib", "num_requests",
                                "num_requests_completed", "num_requests_rejected", "preemptions", "swap_outs",
                                "blocks_swapped", "generated_tokens", "iterations", "bytes_copied",
                                "prefix_cache_hit_blocks", "offload_loaded_blocks", "offload_stored_blocks")},
    "stopped_early": ANY,
    "rejection_reasons": OWN, "throughput_tok_s": OWN, "throughput_req_s": OWN, "wall_time_s": OWN,
    "profile_extrapolation": OWN,
}


def combine_figure(key: str, summaries: list[dict], totals: list[dict]) -> object:
    """The cluster's value of summary figure ``key`` from its replicas' ``summaries`` and ``totals`` by its rule in
    ``CLUSTER_RULES`` (``POOLED`` and ``OWN`` figures: None, the caller computes them)."""
    rule = CLUSTER_RULES[key]
    values = [summary[key] for summary in summaries]
    if rule == SAME:
        return values[0]
    if rule == SUM:
        return sum(values)
    if rule == MAX:
        return max(values)
    if rule == ANY:
        return any(values)
    if rule == BUSY_MEAN:
        busy = [total["busy_s"] for total in totals]
        return float(np.average(values, weights=busy)) if sum(busy) else values[0]
    if rule == RATIO:
        if any(math.isnan(value) for value in values):  # not measured (prefix caching off)
            return math.nan
        numerator, denominator = RATIOS[key]
        below = sum(total[denominator] for total in totals)
        return sum(total[numerator] for total in totals) / below if below else 0.0
    return None
