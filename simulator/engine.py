"""The discrete-event simulator: iteration-level continuous batching over one KV allocation policy.

Time advances one model iteration at a time (a roofline cost per iteration); work per iteration is O(1) plus O(1)
per event (arrival, block needed, completion, preemption). Sequence lengths are not stepped one by one: a running
sequence's KV length is ``kv_len_base + (step - step_base)`` at decode step ``step``, and a calendar keyed by decode
step holds the steps at which it next needs memory or completes.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pandas as pd

from .allocators import ALLOCATORS, ContiguousPolicy, PagedPolicy
from .metrics import MetricsRecorder, latency_summary
from .models import CostModel, GiB, get_gpu, get_model, kv_capacity_tokens, override
from .workloads import Workload

SCHEDULING_MODES = ("prefill-first", "chunked")


@dataclass(slots=True)
class SimConfig:
    """Everything one simulation run needs besides the workload."""

    allocator: str = "paged"
    block_size: int = 16
    model: object = "qwen3-8b"
    gpu: object = "a100-80gb"
    max_model_len: int = 2048
    capacity_tokens: int | None = None  # overrides the KV capacity derived from model and GPU
    gpu_memory_utilization: float = 0.9
    activation_reserve_bytes: float = 1 * GiB
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    scheduling: str = "prefill-first"
    address_space: str = "first-fit"
    enable_prefix_caching: bool = True
    grow_initial_extra: int = 16
    flops_efficiency: float = 0.6
    bandwidth_efficiency: float = 0.85
    step_overhead_s: float = 1e-3
    kernel_csv: str | None = None  # calibrate attention bandwidth from `python -m lab bench kernels` output
    max_points: int = 2000  # timeseries rows kept (decimated uniformly)
    model_overrides: dict = field(default_factory=dict)
    gpu_overrides: dict = field(default_factory=dict)


class Seq:
    """One sampled sequence while it is queued or running."""

    __slots__ = ("rid", "request", "prompt_len", "final_len", "kv_len", "kv_len_base", "step_base", "epoch",
                 "region", "synced_len", "cached_tokens", "final_block_counted", "final_block_slack", "prefilled")

    def __init__(self, rid: int, request: int, prompt_len: int, output_len: int):
        self.rid, self.request, self.prompt_len = rid, request, prompt_len
        self.final_len = prompt_len + output_len
        self.kv_len = prompt_len + 1  # KV length once prefilled (the prompt plus the first generated token)
        self.kv_len_base = self.step_base = self.epoch = self.synced_len = self.cached_tokens = 0
        self.region = None
        self.final_block_counted, self.final_block_slack, self.prefilled = False, 0, 0


@dataclass(slots=True)
class SimResult:
    """``summary`` (one dict), ``timeseries`` (DataFrame, one row per sampled iteration), ``requests`` (per-request
    latencies) and the ``config`` that produced them."""

    summary: dict
    timeseries: pd.DataFrame
    requests: pd.DataFrame
    config: SimConfig


@dataclass(slots=True)
class Snapshot:
    """State handed to ``on_snapshot`` while a run proceeds (for live views)."""

    iteration: int
    time_s: float
    metrics: dict
    pool: object = None  # paged: lab.block_manager.PoolSnapshot (owners, ref counts, block tables)
    free_regions: list[tuple[int, int]] | None = None  # contiguous: (start, size) holes
    regions: dict | None = None  # contiguous: sequence id -> (start, size)
    progress: float = 0.0  # fraction of requests finished or rejected


def build_policy(config: SimConfig, capacity_tokens: int):
    """The allocation policy named by ``config.allocator``."""
    if config.allocator not in ALLOCATORS:
        raise ValueError(f"allocator must be one of {', '.join(ALLOCATORS)}; got {config.allocator!r}")
    if config.allocator == "paged":
        return PagedPolicy(capacity_tokens, config.block_size, config.enable_prefix_caching)
    return ContiguousPolicy(config.allocator, capacity_tokens, config.max_model_len, config.address_space,
                            config.grow_initial_extra)


def resolve_capacity(config: SimConfig) -> tuple[int, CostModel]:
    """KV capacity in tokens and the cost model for a config."""
    model = override(get_model(config.model), **config.model_overrides)
    gpu = override(get_gpu(config.gpu), **config.gpu_overrides)
    cost = CostModel(model, gpu, config.flops_efficiency, config.bandwidth_efficiency, config.step_overhead_s)
    if config.kernel_csv:
        cost.calibrate_from_kernel_csv(config.kernel_csv)
    if config.capacity_tokens is not None:
        if config.capacity_tokens < 1:
            raise ValueError(f"capacity_tokens must be >= 1, got {config.capacity_tokens}")
        return int(config.capacity_tokens), cost
    return kv_capacity_tokens(model, gpu, config.gpu_memory_utilization, config.activation_reserve_bytes), cost


def _check_config(config: SimConfig) -> None:
    if config.scheduling not in SCHEDULING_MODES:
        raise ValueError(f"scheduling must be one of {', '.join(SCHEDULING_MODES)}; got {config.scheduling!r}")
    for name in ("block_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "max_points"):
        if getattr(config, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(config, name)}")


class Simulator:
    """One run of one workload against one allocation policy; call ``run()``."""

    def __init__(self, workload: Workload, config: SimConfig,
                 on_snapshot: Callable[[Snapshot], bool | None] | None = None, snapshot_every: int = 50,
                 snapshot_pool: bool = True):
        _check_config(config)
        if len(workload) == 0:
            raise ValueError("the workload has no requests")
        self.workload, self.config = workload, config
        self.capacity_tokens, self.cost = resolve_capacity(config)
        self.policy = build_policy(config, self.capacity_tokens)
        self.on_snapshot, self.snapshot_every = on_snapshot, max(1, snapshot_every)
        self.snapshot_pool = snapshot_pool  # copying the pool is O(blocks): progress-only callers skip it
        self.time = 0.0
        self.step = 0  # decode steps so far
        self.iteration = 0
        self.waiting: deque[tuple[int, list[Seq]]] = deque()
        self.running: dict[int, Seq] = {}  # admission order: the last one is the newest
        self.prefilling: list[Seq] = []  # chunked mode: admitted, prompt not fully processed yet
        self.memory_calendar: dict[int, list] = {}  # decode step -> [(seq, epoch)] needing memory then
        self.done_calendar: dict[int, list] = {}  # decode step -> sequences completing then
        self.len_offset = 0  # sum over running of (kv_len_base - step_base)
        self.next_rid = 0
        self.num_preemptions = self.generated_tokens = self.copied_tokens = 0
        self.num_requests = len(workload)
        self.first_token_time = np.full(self.num_requests, np.nan)
        self.finish_time = np.full(self.num_requests, np.nan)
        self.samples_left = np.zeros(self.num_requests, dtype=np.int64)
        self.rejected = np.zeros(self.num_requests, dtype=bool)
        self.num_finished = 0
        self.metrics = MetricsRecorder(self.policy.capacity, config.max_points)
        self.stopped = False

    # ---- main loop -------------------------------------------------------------------------------------------
    def run(self) -> SimResult:
        """Simulate until every request has finished (or was rejected), or ``on_snapshot`` returned False."""
        started = time.perf_counter()
        arrivals = self.workload.arrival_s
        next_arrival = 0
        while not self.stopped:
            while next_arrival < self.num_requests and arrivals[next_arrival] <= self.time:
                self._arrive(next_arrival)
                next_arrival += 1
            if not (self.running or self.waiting or self.prefilling):
                if next_arrival >= self.num_requests:
                    break
                self.time = float(arrivals[next_arrival])
                continue
            self._iterate()
        result = self._result()
        result.summary["wall_time_s"] = time.perf_counter() - started
        return result

    def _arrive(self, request: int) -> None:
        outputs = self.workload.outputs_of(request)
        prompt = int(self.workload.prompt_tokens[request])
        final = prompt + max(outputs)
        if final > self.config.max_model_len or not self.policy.can_ever_fit(final):
            self.rejected[request] = True
            return
        seqs = [self._new_seq(request, prompt, out) for out in outputs]
        self.samples_left[request] = len(seqs)
        self.waiting.append((request, seqs))

    def _new_seq(self, request: int, prompt: int, output: int) -> Seq:
        seq = Seq(self.next_rid, request, prompt, output)
        self.next_rid += 1
        return seq

    def _iterate(self) -> None:
        self.iteration += 1
        chunked = self.config.scheduling == "chunked"
        decode_tokens = decode_kv = 0
        if chunked and self.running:  # chunked: decodes are scheduled first, prompts fill the remaining budget
            decode_tokens, decode_kv = self._decode_step()
        prefill_tokens, pairs, cached_read, finished_prefill = self._schedule_prefills(chunked)
        if not chunked and self.running and not prefill_tokens:
            decode_tokens, decode_kv = self._decode_step()
        if not (prefill_tokens or decode_tokens):
            self._drop_unschedulable_head()
            return
        duration = self.cost.iteration_time(prefill_tokens + decode_tokens, pairs + decode_kv,
                                            cached_read + decode_kv) + self._pending_copy_time()
        for seq in finished_prefill:
            self._start_decoding(seq, self.time + duration)
        self.metrics.accumulate(self, duration)
        self.time += duration
        for seq in self.done_calendar.pop(self.step, ()):
            if self.running.get(seq.rid) is seq:
                self._finish(seq)
        if self.iteration % self.snapshot_every == 0 and self.on_snapshot is not None:
            self.stopped = self.on_snapshot(self.snapshot()) is False

    # ---- prefill ---------------------------------------------------------------------------------------------
    def _schedule_prefills(self, chunked: bool):
        """Admit waiting groups FCFS while memory, the sequence cap and the token budget allow, and process prompt
        tokens: whole prompts in prefill-first mode, budget-sized chunks in chunked mode (groups of n > 1 samples
        are prefilled whole). Returns (tokens computed, attention pairs, cached KV tokens read, sequences whose
        prefill ended)."""
        tokens, pairs, cached = 0, 0.0, 0
        done: list[Seq] = []
        if not (self.waiting or self.prefilling):
            return tokens, pairs, cached, done
        budget = self.config.max_num_batched_tokens - (len(self.running) if chunked else 0)
        for seq in list(self.prefilling):  # chunked: continue earlier chunks first
            if budget <= 0:
                break
            take, seq_pairs = self._prefill_chunk(seq, budget)
            tokens, pairs, budget = tokens + take, pairs + seq_pairs, budget - take
            if seq.prefilled >= seq.kv_len - 1:
                self.prefilling.remove(seq)
                done.append(seq)
        while self.waiting and budget > 0:
            request, seqs = self.waiting[0]
            prompt, whole = seqs[0].kv_len - 1, not chunked or len(seqs) > 1
            if len(self.running) + len(self.prefilling) + len(done) + len(seqs) > self.config.max_num_seqs:
                break
            if whole and tokens and prompt > budget:
                break
            if not self._admit(request, seqs):
                break
            self.waiting.popleft()
            parent = seqs[0]
            parent.prefilled = parent.cached_tokens
            cached += parent.cached_tokens
            take, seq_pairs = self._prefill_chunk(parent, prompt if whole else budget)
            tokens, pairs, budget = tokens + take, pairs + seq_pairs, budget - take
            if parent.prefilled >= prompt:
                for seq in seqs:
                    seq.prefilled = prompt
                done.extend(seqs)
            else:
                self.prefilling.append(parent)
        return tokens, pairs, cached, done

    @staticmethod
    def _prefill_chunk(seq: Seq, budget: int) -> tuple[int, float]:
        """Process up to ``budget`` prompt tokens of ``seq``; returns (tokens, causal attention pairs)."""
        start = seq.prefilled
        take = min(budget, seq.kv_len - 1 - start)
        seq.prefilled = start + take
        return take, take * (2 * start + take + 1) / 2

    def _admit(self, request: int, seqs: list[Seq]) -> bool:
        if self.policy.paged:
            ids = self.workload.prompt_token_ids(request) if self.workload.has_shared_prefixes else None
            return self.policy.admit(seqs, ids)
        return self.policy.admit(seqs)

    def _start_decoding(self, seq: Seq, first_token_time: float) -> None:
        """Prefill finished: the first token is out; the sequence decodes from the next step on."""
        seq.kv_len_base, seq.step_base = seq.kv_len, self.step
        self.running[seq.rid] = seq
        self.len_offset += seq.kv_len_base - seq.step_base
        self.generated_tokens += 1
        if np.isnan(self.first_token_time[seq.request]):
            self.first_token_time[seq.request] = first_token_time
        if seq.kv_len >= seq.final_len:
            self._finish(seq, first_token_time)
            return
        self._schedule(seq)

    def _schedule(self, seq: Seq) -> None:
        self.done_calendar.setdefault(seq.step_base + seq.final_len - seq.kv_len_base, []).append(seq)
        self._schedule_memory_event(seq, self.policy.next_event_position(seq))

    def _schedule_memory_event(self, seq: Seq, position: int | None) -> None:
        """Remember the decode step at which ``seq`` reaches KV length ``position`` and needs memory."""
        if position is not None and position is not False and position <= seq.final_len:
            step = seq.step_base + position - seq.kv_len_base
            self.memory_calendar.setdefault(step, []).append((seq, seq.epoch))

    # ---- decode ----------------------------------------------------------------------------------------------
    def _decode_step(self) -> tuple[int, int]:
        """One token for every running sequence; returns (tokens, KV tokens attended)."""
        step = self.step = self.step + 1
        events = self.memory_calendar.pop(step, None)
        if events:
            running, on_event, calendar = self.running, self.policy.on_event, self.memory_calendar
            for seq, epoch in events:  # the common case inline: memory is free, schedule the next event
                if seq.epoch != epoch or running.get(seq.rid) is not seq:
                    continue
                position = on_event(seq, seq.kv_len_base + step - seq.step_base)
                if position is False:
                    self._grow(seq)
                elif position is not None and position <= seq.final_len:
                    calendar.setdefault(seq.step_base + position - seq.kv_len_base, []).append((seq, epoch))
        num_running = len(self.running)
        self.generated_tokens += num_running
        return num_running, self.len_offset + num_running * self.step

    def _grow(self, seq: Seq) -> None:
        """Get ``seq`` the memory it needs now, preempting the newest sequences (possibly itself) until it fits."""
        kv_len = seq.kv_len_base + self.step - seq.step_base
        while (position := self.policy.on_event(seq, kv_len)) is False:
            if len(self.running) == 1 and not self.prefilling:  # alone: preempting itself could never help
                position = self.policy.on_event(seq, kv_len, alone=True)
                if position is not False:
                    break
            victim = self.running[next(reversed(self.running))]
            self._preempt(victim)
            if victim is seq:
                return
        self._schedule_memory_event(seq, position)

    def _preempt(self, seq: Seq) -> None:
        """Recompute preemption: free the sequence's KV and queue it first; it resumes with its prompt plus the
        tokens it had generated as the new prompt."""
        kv_len_before = seq.kv_len_base + (self.step - 1) - seq.step_base
        self._leave_running(seq, kv_len_before)
        self.num_preemptions += 1
        resumed = Seq(seq.rid, seq.request, kv_len_before, seq.final_len - kv_len_before)
        resumed.epoch = seq.epoch + 1
        self.waiting.appendleft((seq.request, [resumed]))

    def _leave_running(self, seq: Seq, kv_len: int) -> None:
        del self.running[seq.rid]
        self.len_offset -= seq.kv_len_base - seq.step_base
        seq.epoch += 1
        if self.policy.paged:
            self.policy.release(seq, kv_len)
        else:
            self.policy.release(seq)

    def _finish(self, seq: Seq, when: float | None = None) -> None:
        self._leave_running(seq, seq.final_len)
        self.samples_left[seq.request] -= 1
        if self.samples_left[seq.request] == 0:
            self.finish_time[seq.request] = self.time if when is None else when
            self.num_finished += 1

    def _drop_unschedulable_head(self) -> None:
        """Nothing ran: the head of the queue cannot be admitted even into an idle pool. Reject it."""
        if self.waiting and not self.running and not self.prefilling:
            request, _ = self.waiting.popleft()
            self.rejected[request] = True
            self.samples_left[request] = 0

    def _pending_copy_time(self) -> float:
        if self.policy.paged:
            return 0.0
        copied = self.policy.copied_tokens
        new = copied - self.copied_tokens
        self.copied_tokens = copied
        return self.cost.copy_time(new) if new else 0.0

    # ---- observation -----------------------------------------------------------------------------------------
    def held_tokens(self) -> int:
        """KV tokens of all running and prefilling sequences, a shared block counted once per holder."""
        tokens = self.len_offset + len(self.running) * self.step
        if self.prefilling:
            tokens += sum(s.prefilled for s in self.prefilling)
        return tokens

    def snapshot(self) -> Snapshot:
        done = self.num_finished + int(self.rejected.sum())
        snap = Snapshot(self.iteration, self.time, self.metrics.current(self), progress=done / self.num_requests)
        if not self.snapshot_pool:
            return snap
        if self.policy.paged:
            snap.pool = self.policy.manager.snapshot()
        else:
            snap.free_regions = self.policy.space.regions_free()
            snap.regions = {rid: seq.region for rid, seq in self.running.items()}
        return snap

    def _result(self) -> SimResult:
        requests = pd.DataFrame({"arrival_s": self.workload.arrival_s, "prompt_tokens": self.workload.prompt_tokens,
                                 "output_tokens": self.workload.output_tokens, "rejected": self.rejected,
                                 "first_token_s": self.first_token_time, "finish_s": self.finish_time})
        summary = {"allocator": self.config.allocator, "block_size": self.config.block_size
                   if self.config.allocator == "paged" else np.nan, "capacity_tokens": self.policy.capacity,
                   **self.metrics.summary(), **latency_summary(requests, self.workload.n),
                   "num_requests": self.num_requests, "num_requests_completed": self.num_finished,
                   "num_requests_rejected": int(self.rejected.sum()), "preemptions": self.num_preemptions,
                   "generated_tokens": self.generated_tokens, "iterations": self.iteration,
                   "simulated_time_s": self.time, "bytes_copied": self.copied_tokens
                   * self.cost.model.kv_bytes_per_token, "stopped_early": self.stopped}
        summary["throughput_tok_s"] = self.generated_tokens / self.time if self.time > 0 else 0.0
        summary["throughput_req_s"] = self.num_finished / self.time if self.time > 0 else 0.0
        if self.policy.paged:
            stats = self.policy.manager.prefix_cache_stats
            summary["prefix_cache_hit_rate"] = stats.hit_rate
            summary["prefix_cache_hit_blocks"] = stats.hit_blocks
        return SimResult(summary, self.metrics.timeseries(), requests, self.config)
