"""The discrete-event simulator: the engine's scheduler (``lab.sched.scheduler``) with a clock instead of a model.

Each iteration the shared ``Scheduler`` plans a step exactly as it does for ``LLMEngine``; the simulator prices the
plan with the cost model (roofline) instead of running Qwen3, and knows from the workload when each sequence ends.
Work per iteration is O(1) plus O(1) per event (arrival, block needed, completion, preemption, swap): the scheduler
keeps sequence lengths implicit and a calendar of memory events; the simulator keeps a calendar of completions.
Between events, a stretch of steps in which the batch only decodes is run without planning each (``_skip_quiet``),
with the same arithmetic step by step: the results are the same to the last bit.
"""
from __future__ import annotations

import dataclasses
import heapq
import math
import time
from array import array
from pathlib import Path
from dataclasses import dataclass, field
from itertools import accumulate, cycle, islice
from typing import Callable

import numpy as np
import pandas as pd

from lab.checks import check_bool, check_choice, check_int, check_real, entry_point
from lab.errors import InputError, LabError
from lab.kv_cache.block_manager import TokenIds
from lab.kv_cache.precision import KV_CACHE_DTYPES, check_kv_cache_dtype, kv_element_bytes
from lab.latency import counted_tokens, latency_summary
from lab.sched.kv_policy import PagedPolicy, default_num_cpu_blocks, host_pool_blocks
from lab.profiling.profile import RANGE_QUANTITIES, Profile
from lab.sched.scheduler import (PREEMPTION_MODES, SCHEDULING_MODES, RequestRejectedError, Scheduler,
                           SchedulerConfig, SchedulingSettings, Sequence, SequenceGroup, StepStats)

from .allocators import ADDRESS_SPACES, ALLOCATORS, ContiguousPolicy
from .beams import BeamSurvival
from .metrics import COLUMNS, MetricsRecorder, format_rejections, quiet_row, row
from .models import CostModel, GiB, check_tensor_parallel, get_gpu, get_model, kv_capacity_tokens, override
from .workloads import Workload, WorkloadError


ROUTERS = ("round-robin", "least-loaded", "random")
MAX_BLOCKS = 1 << 24  # blocks a paged pool may have (each is tracked: ~16.7 M, ~1 GB of Python lists)
MAX_CAPACITY_TOKENS = 1 << 40


MAX_STEP_S = 1e6  # one step longer than 11 days is a broken cost model or profile, not a GPU
# Quiet decode steps (the batch decodes, nothing else happens) are run in one go when at least QUIET_STEPS_MIN come
# in a row (Simulator._skip_quiet); FAST_FORWARD = False plans every step (the same results: an A/B, a test).
FAST_FORWARD = True
QUIET_STEPS_MIN, QUIET_STEPS_MAX = 2, 1 << 20


class SimulationError(LabError):
    """A run cannot go on truthfully (a step priced at a non-finite or absurd duration)."""


FILE_FIELDS = ("profile", "kernel_csv")  # SimConfig fields that may name a file: a run reads its content


@entry_point
@dataclass(slots=True)
class SimConfig(SchedulingSettings):
    """Everything one simulation run needs besides the workload."""

    allocator: str = "paged"
    block_size: int = 16
    model: object = "qwen3-8b"
    gpu: object = "a100-80gb"
    tp: int = 1  # tensor-parallel GPUs per replica
    max_model_len: int = 2048
    capacity_tokens: int | None = None  # overrides the KV capacity derived from model and GPU
    gpu_memory_utilization: float = 0.9
    activation_reserve_bytes: float = 1 * GiB
    # host slots of the prefix cache's offload tier (lab.kv_cache.offload; paged with prefix caching; 0: none, None: unbounded)
    kv_offload_blocks: int | None = 0
    record_steps: bool = False  # keep the per-step log (SimResult.steps), as LLMEngine.step_log() has
    address_space: str = "first-fit"
    enable_prefix_caching: bool = True
    grow_initial_extra: int = 16
    flops_efficiency: float = 0.6
    bandwidth_efficiency: float = 0.85
    step_overhead_s: float = 1e-3
    kernel_csv: str | None = None  # calibrate attention bandwidth from `python -m lab bench kernels` output
    profile: object = None  # a lab.profiling.profile.Profile or its JSON path: step times measured on the engine (the twin)
    max_points: int = 2000  # timeseries rows kept (decimated uniformly)
    model_overrides: dict = field(default_factory=dict)
    gpu_overrides: dict = field(default_factory=dict)
    replicas: int = 1  # copies of this configuration behind a request router (simulator.core.cluster)
    router: str = "round-robin"  # round-robin | least-loaded (fewest outstanding requests) | random
    seed: int = 0  # seeds the beam-survival model (simulator.core.beams)
    kv_cache_dtype: str = "auto"  # the KV cache's element type, vLLM's names (lab.kv_cache.precision; fp8: 1 byte)

    @property
    def label(self) -> str:
        """The allocator, with the block size for paged (``paged-B16``): a run's name in tables and tabs."""
        return self.allocator if self.allocator != "paged" else f"paged-B{self.block_size}"


@dataclass(slots=True)
class SimResult:
    """``summary`` (one dict), ``timeseries`` (DataFrame, one row per sampled iteration), ``requests`` (per-request
    latencies), the ``config`` that produced them and, when ``config.record_steps``, ``steps`` (the step log, the
    same columns as ``LLMEngine.step_log()``), and ``totals``: the additive quantities behind the summary's means and
    ratios (``MetricsRecorder.totals``, the prefix cache's and the offload tier's block counts), which a cluster sums
    over its replicas (``simulator.core.metrics.CLUSTER_RULES``)."""

    summary: dict
    timeseries: pd.DataFrame
    requests: pd.DataFrame
    config: SimConfig
    steps: pd.DataFrame | None = None
    totals: dict = field(default_factory=dict)


@dataclass(slots=True)
class Snapshot:
    """State handed to ``on_snapshot`` while a run proceeds (for live views)."""

    iteration: int
    time_s: float
    metrics: dict  # the timeseries row (simulator.core.metrics.COLUMNS) of this step
    stats: StepStats | None = None  # the step's record, as the engine emits it
    pool: object = None  # paged: lab.kv_cache.pool_view.PoolSnapshot (owners, ref counts, block tables)
    free_regions: list[tuple[int, int]] | None = None  # contiguous: (start, size) holes
    regions: dict | None = None  # contiguous: sequence id -> (start, size)
    progress: float = 0.0  # fraction of requests finished or rejected


def build_policy(config: SimConfig, capacity_tokens: int, block_bytes: int):
    """The allocation policy named by ``config.allocator``; ``block_bytes``: one block's KV on one GPU (what sizes
    the default host pool)."""
    if config.allocator not in ALLOCATORS:
        raise InputError(f"allocator must be one of {', '.join(ALLOCATORS)}; got {config.allocator!r}")
    if config.allocator == "paged":
        num_blocks = capacity_tokens // config.block_size
        if num_blocks < 1:
            raise InputError(f"capacity of {capacity_tokens} tokens holds no block of {config.block_size}")
        cpu_blocks = config.num_cpu_blocks or (default_num_cpu_blocks(num_blocks, block_bytes)
                                               if config.preemption_mode == "swap" else 0)
        largest = max(num_blocks, host_pool_blocks(cpu_blocks, config.kv_offload_blocks, config.enable_prefix_caching))
        if largest > MAX_BLOCKS:
            raise InputError(f"a pool of {largest} blocks is more than the simulator tracks ({MAX_BLOCKS}); use a "
                             f"larger block size, a smaller capacity or a smaller host tier")
        return PagedPolicy(num_blocks, config.block_size, config.enable_prefix_caching, cpu_blocks,
                           config.kv_offload_blocks)
    if config.kv_offload_blocks != 0:
        raise InputError("kv_offload_blocks needs allocator='paged' (the tier keeps the prefix cache's blocks)")
    if config.preemption_mode == "swap":
        raise InputError("preemption_mode='swap' needs allocator='paged' (contiguous baselines recompute)")
    return ContiguousPolicy(config.allocator, capacity_tokens, config.max_model_len, config.address_space,
                            config.grow_initial_extra)


MAX_OFFLOAD_GIB = 2**20  # a host tier past 1 PiB is a typo for "unbounded" (inf), not a machine


def offload_blocks(config: SimConfig, gib: float) -> int | None:
    """The offload tier's blocks in ``gib`` GiB of host memory for ``config``'s model and block size (None:
    unbounded)."""
    if not isinstance(gib, (int, float)) or isinstance(gib, bool) or not gib >= 0:
        raise InputError(f"the offload tier's size must be a number >= 0 GiB (inf: unbounded), got {gib!r}")
    if gib == math.inf:
        return None
    if gib > MAX_OFFLOAD_GIB:
        raise InputError(f"the offload tier's size must be at most {MAX_OFFLOAD_GIB:,} GiB (1 PiB; inf: unbounded), "
                         f"got {gib:g}")
    return int(gib * 2**30 // resolve_capacity(config)[1].block_bytes(config.block_size))


def resolve_capacity(config: SimConfig) -> tuple[int, CostModel]:
    """KV capacity in tokens and the cost model for a config."""
    model = override(get_model(config.model), **config.model_overrides)
    model = dataclasses.replace(model, kv_dtype_bytes=kv_element_bytes(config.kv_cache_dtype, model.dtype_bytes))
    check_tensor_parallel(model, config.tp)
    gpu = override(get_gpu(config.gpu), **config.gpu_overrides)
    cost = CostModel(model, gpu, config.flops_efficiency, config.bandwidth_efficiency, config.step_overhead_s,
                     tp=config.tp, block_size=config.block_size if config.allocator == "paged" else None)
    if config.kernel_csv:
        cost.calibrate_from_kernel_csv(config.kernel_csv)
    if config.capacity_tokens is not None:
        if config.capacity_tokens < 1:
            raise InputError(f"capacity_tokens must be >= 1, got {config.capacity_tokens}")
        return int(config.capacity_tokens), cost
    return kv_capacity_tokens(model, gpu, config.gpu_memory_utilization, config.activation_reserve_bytes,
                              config.tp), cost


def load_profile(config: SimConfig) -> Profile | None:
    """The config's step-time profile (loaded from its path), checked against the block size."""
    if config.profile is None:
        return None
    profile = config.profile if isinstance(config.profile, Profile) else Profile.load(config.profile)
    profile.check_matches(block_size=config.block_size)
    return profile


def check_config(config: SimConfig) -> None:
    """Raise ``ValueError`` naming the first field of a wrong type or out of range (before anything is built)."""
    owner, big = "SimConfig", 1 << 31
    check_choice(owner, "scheduling", config.scheduling, SCHEDULING_MODES)
    check_choice(owner, "preemption_mode", config.preemption_mode, PREEMPTION_MODES)
    check_choice(owner, "allocator", config.allocator, ALLOCATORS)
    check_choice(owner, "address_space", config.address_space, ADDRESS_SPACES)
    for name in ("block_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "max_points",
                 "grow_initial_extra"):
        check_int(owner, name, getattr(config, name), 1, big)
    check_int(owner, "num_cpu_blocks", config.num_cpu_blocks, 0, MAX_BLOCKS)
    check_int(owner, "kv_offload_blocks", config.kv_offload_blocks, 0, MAX_BLOCKS, optional=True)
    check_int(owner, "replicas", config.replicas, 1, 4096)
    check_int(owner, "tp", config.tp, 1, 64)
    check_int(owner, "seed", config.seed, 0, 2**63 - 1)
    check_choice(owner, "router", config.router, ROUTERS)
    check_int(owner, "capacity_tokens", config.capacity_tokens, 1, MAX_CAPACITY_TOKENS, optional=True)
    for name in ("enable_prefix_caching", "record_steps"):
        check_bool(owner, name, getattr(config, name))
    for name in ("gpu_memory_utilization", "flops_efficiency", "bandwidth_efficiency"):
        check_real(owner, name, getattr(config, name), 0.0, 1.0, low_open=True)
    check_real(owner, "activation_reserve_bytes", config.activation_reserve_bytes, 0.0, 1e18)
    check_real(owner, "step_overhead_s", config.step_overhead_s, 0.0, 1e6)
    if config.profile is not None and not isinstance(config.profile, (str, Path, Profile)):
        raise InputError(f"SimConfig.profile={config.profile!r}: expected None, a profile path or a lab.profiling.profile.Profile")
    check_kv_cache_dtype(owner, config.kv_cache_dtype)
    if config.profile is not None and config.kv_cache_dtype != "auto":
        raise InputError(f"SimConfig.kv_cache_dtype={config.kv_cache_dtype!r} with a profile: a profile prices the "
                         f"engine it measured, whose KV cache held the model's dtype; use the roofline (no profile)")
    if config.profile is not None and config.capacity_tokens is None:
        raise InputError("SimConfig.profile needs capacity_tokens: the engine's pool (num_blocks x block_size)")
    for name in ("model_overrides", "gpu_overrides"):
        if not isinstance(getattr(config, name), dict):
            raise InputError(f"SimConfig.{name}={getattr(config, name)!r}: expected a dict of spec fields")
    scheduler_config(config).check()  # a scheduler setting the others make moot is refused (moot_settings)
    if config.kv_offload_blocks != 0 and (config.allocator != "paged" or not config.enable_prefix_caching):
        raise InputError(f"SimConfig.kv_offload_blocks={config.kv_offload_blocks!r} would be ignored: the offload tier "
                         f"keeps the paged prefix cache's blocks (allocator='paged' with prefix caching on)")
    if config.preemption_mode == "swap" and config.allocator != "paged":
        raise InputError("preemption_mode='swap' needs allocator='paged' (contiguous baselines recompute)")
    if "kv_dtype_bytes" in config.model_overrides:
        raise InputError("model_overrides may not set kv_dtype_bytes: the KV cache's element type is "
                         "SimConfig.kv_cache_dtype (auto, fp8, fp8_e4m3, fp8_e5m2)")


def scheduler_config(config: SimConfig) -> SchedulerConfig:
    """The scheduler settings of a simulation (the engine builds the same from its own config)."""
    return SchedulerConfig.of(config, max_model_len=config.max_model_len, sync_every_step=False,
                              track_longest=config.profile is not None)


def _blocks_reserved(ahead: int, sizes: list[int] | None, offset: int) -> int:
    """Blocks the next ``ahead`` quiet steps reserve (``sizes``: the blocks of each phase bucket, cycling, the next
    step's at ``offset``; None when no bucket has a sequence)."""
    if not sizes:
        return 0
    if offset + ahead <= len(sizes):
        return sum(sizes[offset:offset + ahead])
    full, rest = divmod(ahead, len(sizes))
    return full * sum(sizes) + sum(islice(cycle(sizes), offset, offset + rest))


def synthetic_token_ids(workload: Workload, request: int, length: int, prompt=None) -> list[int]:
    """The first ``length`` token ids of a request's stream for prefix caching: the workload's prompt ids where it
    shares prefixes, else ids unique to the request. Generated positions get ids that depend only on the whole
    prompt and the position, so requests with identical prompts, and the samples of one request, continue alike,
    as greedy decoding does. ``prompt``: the request's ``workload.prompt_token_ids`` when the caller has them."""
    if prompt is None:
        prompt = workload.prompt_token_ids(request)
    if prompt is None:
        unique_base = -(request + 1) * (1 << 24)
        return list(range(unique_base, unique_base + length))
    if length <= len(prompt):
        return prompt if length == len(prompt) else prompt[:length]
    generated_base = -(1 << 62) + (hash(tuple(prompt)) % (1 << 40)) * (1 << 20)  # below every prompt id
    return [*prompt, *range(generated_base + len(prompt), generated_base + length)]


@entry_point
class Simulator:
    """One replica's run of one workload against one allocation policy; call ``run()``. A cluster of replicas
    (``config.replicas > 1``) is ``simulator.core.cluster.run_simulation``'s: it builds one of these per replica."""

    def __init__(self, workload: Workload, config: SimConfig,
                 on_snapshot: Callable[[Snapshot], bool | None] | None = None, snapshot_every: int = 50,
                 snapshot_pool: bool = True, requests: list[int] | None = None):
        """``requests``: the indices of the workload's requests this simulator serves, in arrival order (default:
        all; a cluster's router hands each replica its own, up front or with ``assign``)."""
        check_config(config)
        if config.replicas != 1:
            raise InputError(f"Simulator runs one replica (replicas={config.replicas}); "
                             f"simulator.run_simulation runs a cluster")
        if not isinstance(workload, Workload):
            raise WorkloadError(f"expected a simulator.Workload, got {type(workload).__name__}")
        workload.check()
        if workload.beam_width > 1 and (workload.n > 1 or workload.sample_output_tokens is not None):
            raise InputError(f"Workload: beam_width={workload.beam_width} with n={workload.n} samples: a request "
                             f"samples or beam-searches, not both")
        self.workload, self.config = workload, config
        self.capacity_tokens, self.cost = resolve_capacity(config)
        self.profile = load_profile(config)
        self.profile_highest = [0.0] * len(RANGE_QUANTITIES)  # the largest step quantities priced by the profile
        self.profile_step_time = self.profile.predictor(self.profile_highest) if self.profile is not None else None
        self.policy = build_policy(config, self.capacity_tokens, int(self.cost.block_bytes(config.block_size)))
        self.scheduler = Scheduler(scheduler_config(config), self.policy)
        if config.record_steps:
            self.scheduler.step_rows = []
        self.track_tokens = self.policy.caches_prefixes
        self.shares_prefixes = self.track_tokens and workload.has_shared_prefixes  # prompts by token ids, else streams
        self.on_snapshot, self.snapshot_every = on_snapshot, max(1, snapshot_every)
        self.snapshot_pool = snapshot_pool  # copying the pool is O(blocks): progress-only callers skip it
        self.time = 0.0
        self.idle_s = 0.0  # how long the engine sat idle (nothing to run) before the next step
        self.previous_prefill_tokens = 0  # the last step's (a profile's step time depends on it)
        # a profile's per-request add_request time, and what arrivals since the last step owe: the engine admits
        # them between steps, which delays the next one
        self.add_request_s = self.profile.add_request_s if self.profile is not None else 0.0
        self.admission_s = 0.0
        self.iteration = 0
        self.done_calendar: dict[int, list] = {}  # decode step -> [(seq, epoch)] completing then
        self.done_steps: list[int] = []  # its steps as a heap (the next finish without a scan)
        self.next_seq_id = 0
        self.generated_tokens = self.copied_tokens = self.swapped_blocks = self.discarded_tokens = 0
        self.num_requests = len(workload)
        # per request: arrays of C doubles and lists (a numpy scalar costs ~1 us an access); numpy in the result
        self.first_token_time = array("d", [math.nan]) * self.num_requests
        self.first_step_start = array("d", [math.nan]) * self.num_requests  # the step that made the first token
        self.finish_time = array("d", [math.nan]) * self.num_requests
        self.samples_left = [0] * self.num_requests
        self._prompt_ids: dict[int, TokenIds] = {}  # requests admitted or offered, until they finish
        self.rejected = [False] * self.num_requests
        self.rejection_reasons: dict[str, int] = {}
        self.num_finished = self.num_rejected = 0
        self.metrics = MetricsRecorder(self.policy.capacity, config.max_points)
        self.stopped = False
        self.owned = list(range(self.num_requests)) if requests is None else list(requests)
        self.next_arrival = 0  # index into owned
        self.next_arrival_s = math.inf  # arrival time of owned[next_arrival]
        self._update_next_arrival()

    # the scheduler's queues, for metrics and views
    @property
    def running(self) -> dict:
        return self.scheduler.running

    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def prefilling(self) -> list:
        return self.scheduler.prefilling

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    def held_tokens(self) -> int:
        return self.scheduler.held_tokens()

    # ---- main loop -------------------------------------------------------------------------------------------
    def run(self) -> SimResult:
        """Simulate until every request has finished (or was rejected), or ``on_snapshot`` returned False."""
        started = time.perf_counter()
        self.advance(math.inf)
        return self.finish_run(started)

    def advance(self, until: float) -> None:
        """Run iterations while there is work and the clock is before ``until`` (an iteration that starts before
        ``until`` may end after it); requests arrive as the clock passes them."""
        scheduler = self.scheduler
        while not self.stopped:
            while self.next_arrival_s <= self.time:
                self._arrive(self.owned[self.next_arrival])
                self.next_arrival += 1
                self._update_next_arrival()
            if not scheduler.has_unfinished():
                arrival = self.next_arrival_s
                if arrival >= until:  # inf when every owned request has arrived
                    return
                self.idle_s += arrival - self.time
                self.time = arrival
                continue
            if self.time >= until:
                return
            if not (FAST_FORWARD and self._skip_quiet(until)):
                self._iterate()

    def assign(self, request: int) -> None:
        """Serve ``request`` too (a router's decision; requests are assigned in arrival order)."""
        self.owned.append(request)
        self._update_next_arrival()

    def _update_next_arrival(self) -> None:
        owned = self.owned
        self.next_arrival_s = float(self.workload.arrival_s[owned[self.next_arrival]]) \
            if self.next_arrival < len(owned) else math.inf

    def queue_now(self, request: int) -> None:
        """Serve ``request`` and queue it now, whatever its arrival time (a replay that admits requests by step
        count; follow with ``iterate``)."""
        self.assign(request)
        self._arrive(request)
        self.next_arrival += 1
        self._update_next_arrival()

    def iterate(self, idle_s: float = 0.0) -> None:
        """Run one iteration now (a replay's driver; ``run``/``advance`` run iterations by the clock);
        ``idle_s``: how long the engine being replayed sat idle before this step (see ``lab.profiling.profile.IDLE_KNOTS_S``)."""
        self.idle_s = idle_s
        self._iterate()

    def outstanding(self) -> int:
        """Requests assigned and not yet finished or rejected (what a least-loaded router compares)."""
        return len(self.owned) - self.num_finished - self.num_rejected

    def finish_run(self, started: float) -> SimResult:
        result = self._result()
        result.summary["wall_time_s"] = time.perf_counter() - started
        return result

    def _arrive(self, request: int) -> None:
        outputs = self.workload.outputs_of(request)
        prompt = int(self.workload.prompt_tokens[request])
        try:
            self.scheduler.check_request(prompt, max(outputs), len(outputs), self.workload.beam_width > 1)
        except RequestRejectedError as error:
            self._reject(request, error.reason)
            return
        if not self.track_tokens:
            group = SequenceGroup(request, [])
        elif self.shares_prefixes:
            group = SequenceGroup(request, [], self._token_ids)
        else:  # content unique to the request: prefix caching by stream position, no token lists
            group = SequenceGroup(request, [], stream_key=request)
        if self.workload.beam_width > 1:
            group.beam = BeamSurvival(self.config.seed, request)
        for sample, output in enumerate(outputs):
            group.seqs.append(Sequence(self.next_seq_id, group, sample, prompt, prompt + output - 1))
            self.next_seq_id += 1
        self.samples_left[request] = len(outputs)
        self.scheduler.add(group)
        self.admission_s += self.add_request_s

    def _token_ids(self, seq: Sequence, length: int):
        """A request's ids (``synthetic_token_ids``), its prompt's built once until it finishes: they are needed
        when it is admitted and again, past its prompt, when it leaves (its sampled blocks are cached then)."""
        request = seq.group.request_id
        prompt = self._prompt_ids.get(request)
        if prompt is None:
            prompt = self._prompt_ids[request] = TokenIds.unchecked(self.workload.prompt_token_ids(request))
        return synthetic_token_ids(self.workload, request, length, prompt)

    def _reject(self, request: int, reason: str) -> None:
        self.num_rejected += 1
        self.rejected[request] = True
        self.samples_left[request] = 0
        self.rejection_reasons[reason] = self.rejection_reasons.get(reason, 0) + 1

    def _iterate(self) -> None:
        scheduler = self.scheduler
        step_before = scheduler.step
        out = scheduler.schedule()
        if out.is_empty:
            head = scheduler.drop_unschedulable_head()
            if head is not None:
                self._reject(head.request_id, "capacity")
            return
        self.iteration += 1
        if self.profile is not None:  # measured on the engine: copies and swaps are among its features
            duration = self.profile_step_time(out, self.idle_s, self.previous_prefill_tokens)
            self.previous_prefill_tokens = out.num_prefill_tokens
            self.swapped_blocks += len(out.blocks_to_swap_out) + len(out.blocks_to_swap_in)
        else:
            duration = self.cost.iteration_time(out.num_prefill_tokens + out.num_decode_seqs,
                                                out.prefill_attention_pairs + out.decode_kv_tokens,
                                                out.cached_tokens_read + out.decode_kv_tokens, out.num_decode_seqs)
            if self.policy.copied_tokens != self.copied_tokens:
                duration += self._pending_copy_time()
            if out.blocks_to_swap_out or out.blocks_to_swap_in:
                duration += self._swap_time(out)
        if not 0.0 <= duration <= MAX_STEP_S:  # NaN fails too: a clock that never advances would loop forever
            raise SimulationError(f"step {self.iteration} was priced at {duration!r} s by the "
                                  f"{'profile' if self.profile is not None else 'cost model'}; a step takes a finite "
                                  f"time in [0, {MAX_STEP_S:g}] s (check the profile, kernel CSV or model/GPU figures)")
        self.idle_s = 0.0
        if self.admission_s:
            self.time += self.admission_s
            self.admission_s = 0.0
        end = self.time + duration
        self.generated_tokens += out.num_decode_seqs + len(out.prefill_done)
        if scheduler.num_discarded_tokens != self.discarded_tokens:  # a restarted beam search's are not output
            self.generated_tokens -= scheduler.num_discarded_tokens - self.discarded_tokens
            self.discarded_tokens = scheduler.num_discarded_tokens
        # sampled before any sequence finishes: a one-token request holds its prompt during the step that prefills it
        values = self.policy.memory_sample(scheduler.held_tokens())
        self.metrics.accumulate(values, scheduler.num_running_seqs, duration)
        if out.prefill_done:
            for seq in out.prefill_done:
                self._start_decoding(seq, end, end - duration)
        if out.swapped_in:
            for seq in out.swapped_in:
                self._schedule_done(seq)
        self.time = end
        if scheduler.step != step_before:
            running = scheduler.running
            for seq, epoch in self.done_calendar.pop(scheduler.step, ()):
                if seq.epoch == epoch and running.get(seq.seq_id) is seq:
                    self._finish(seq)
        row_due = self.metrics.due(self.iteration)
        snapshot_due = self.on_snapshot is not None and self.iteration % self.snapshot_every == 0
        stats = scheduler.end_step(duration, self.time, self.generated_tokens, want_stats=row_due or snapshot_due)
        if row_due:
            # finishing freed memory after ``values`` was taken
            values = self._categories() if stats.num_finished else values.categories()
            self.metrics.record(stats, values, self.num_preemptions, self._prefix_cache_hits())
        if snapshot_due:
            self.stopped = self.on_snapshot(self.snapshot(stats)) is False

    def _skip_quiet(self, until: float) -> bool:
        """Run the next quiet steps (``Scheduler.quiet_decode_steps``: the batch decodes and nothing else happens)
        at once, with ``_iterate``'s arithmetic step by step: each step priced by the cost model, the clock, the
        memory sums and the due timeseries rows; up to the next arrival, finish, snapshot or ``until``. False (and
        nothing done) when the next step is not quiet."""
        scheduler = self.scheduler
        if self.profile is not None or self.admission_s or self.policy.copied_tokens != self.copied_tokens:
            return False
        steps = QUIET_STEPS_MAX
        if self.on_snapshot is not None:
            steps = self.snapshot_every - self.iteration % self.snapshot_every - 1
        done_steps, calendar = self.done_steps, self.done_calendar
        while done_steps and done_steps[0] not in calendar:  # finished steps leave the calendar, not the heap
            heapq.heappop(done_steps)
        if done_steps:  # up to the next finish
            steps = min(steps, done_steps[0] - scheduler.step - 1)
        if steps < QUIET_STEPS_MIN:  # the cheap bounds first: most steps of a busy replay end here
            return False
        steps = scheduler.quiet_decode_steps(steps)
        if steps < QUIET_STEPS_MIN:
            return False
        batch, metrics, iteration_time = len(scheduler.running), self.metrics, self.cost.iteration_time
        first = self.policy.memory_sample(scheduler.held_tokens() + batch)  # before the first step's reservation
        # Paged: the blocks reserved since ``first`` by the ``ahead`` steps so far (``sizes``: blocks each step
        # reserves, cycling; ``_blocks_reserved``) and the slots settled as never filled (sequences whose last block a
        # step reserves; ``marks``: (steps, slots so far) where that changes)
        period, start, ends = scheduler.period, scheduler.step, scheduler.periodic_ends
        block_size = self.policy.block_size if period else 0
        sizes = scheduler.bucket_sizes if scheduler.bucket_total else None  # the next step's at ``offset``
        offset = (start + 1) % period if period else 0
        never_filled, marks = 0, []
        kv_tokens = scheduler.len_offset + batch * scheduler.step
        time, generated, durations = self.time, self.generated_tokens, []
        first_row = None  # the first quiet step's timeseries row, which the others' are spliced from
        stop_at = min(until, self.next_arrival_s)  # a step starts only before both (as advance() would run it)
        for ahead in range(1, steps + 1):
            if time >= stop_at:
                break
            kv_tokens += batch
            duration = iteration_time(batch, 0.0 + kv_tokens, kv_tokens, batch)  # _iterate's decode-only plan
            if not 0.0 <= duration <= MAX_STEP_S:
                break  # _iterate prices it again and says why
            time += duration
            generated += batch
            durations.append(duration)
            if period and start + ahead in ends:
                never_filled += scheduler.settle_periodic_ends(start + ahead)
                marks.append((ahead, never_filled))
            if metrics.due(self.iteration + ahead):
                if first_row is None:
                    first_row = row(scheduler.quiet_step_stats(), first.categories(),
                                    self.num_preemptions, self._prefix_cache_hits())
                blocks = _blocks_reserved(ahead, sizes, offset)
                shift, slots = (ahead - 1) * batch, blocks * block_size
                metrics.append(quiet_row(first_row, ahead - 1, duration, time, generated,
                                         (first.token_states + shift, first.reserved - shift + slots - never_filled,
                                          first.internal_fragmentation + never_filled,
                                          first.external_fragmentation, first.free - slots), blocks))
        if not durations:
            return False
        count = len(durations)
        taken = settled = None
        if period:
            if sizes:  # the slots the first 1, 2, ... count steps reserve
                steps = sizes[offset:offset + count] if offset + count <= period else \
                    islice(cycle(sizes), offset, offset + count)
                taken = [blocks * block_size for blocks in accumulate(steps)]
            else:
                taken = [0] * count
            settled, done, value = [], 0, 0
            for ahead, total in marks:  # step ``ahead`` and those after it have ``total`` settled
                settled += [value] * (ahead - 1 - done)
                done, value = ahead - 1, total
            settled += [value] * (count - done)
        metrics.accumulate_run(first, batch, batch, durations, taken, settled)
        scheduler.skip_quiet_steps(count, taken[-1] // block_size if sizes else 0)
        self.iteration += len(durations)
        self.time, self.generated_tokens, self.idle_s = time, generated, 0.0
        return True

    def _start_decoding(self, seq: Sequence, first_token_time: float, step_start: float) -> None:
        """Prefill done: its first token is out at the end of this iteration (which began at ``step_start``)."""
        request = seq.group.request_id
        if math.isnan(self.first_token_time[request]):
            self.first_token_time[request] = first_token_time
            self.first_step_start[request] = step_start
        if seq.prompt_len >= seq.final_len:
            self._finish(seq, first_token_time)
        else:
            self._schedule_done(seq)

    def _schedule_done(self, seq: Sequence) -> None:
        step = seq.step_base + seq.final_len - seq.kv_len_base
        if step not in self.done_calendar:
            heapq.heappush(self.done_steps, step)
        self.done_calendar.setdefault(step, []).append((seq, seq.epoch))

    def _finish(self, seq: Sequence, when: float | None = None) -> None:
        self.scheduler.finish(seq)
        request = seq.group.request_id
        self.samples_left[request] -= 1
        if self.samples_left[request] == 0:
            self.finish_time[request] = self.time if when is None else when
            self.num_finished += 1
            self._prompt_ids.pop(request, None)
            # The group and its sequences reference each other: drop the list so that reference counting frees
            # them now, while their memory is hot, instead of the cyclic GC later (3-4 % of a replay's time).
            seq.group.seqs = []

    def _categories(self) -> tuple[int, int, int, int, int]:
        """The memory categories now (``simulator.core.metrics.CATEGORIES``)."""
        return self.policy.memory_sample(self.scheduler.held_tokens()).categories()

    def _prefix_cache_hits(self) -> int:
        stats = self.policy.prefix_cache_stats()
        return stats.hit_blocks if stats is not None else 0

    def _pending_copy_time(self) -> float:
        copied = self.policy.copied_tokens
        new = copied - self.copied_tokens
        self.copied_tokens = copied
        return self.cost.copy_time(new) if new else 0.0

    def _swap_time(self, out) -> float:
        """Host-link time of the step's swaps and offload-tier copies, priced alike (vLLM's connector, like swap,
        copies before the forward that needs the blocks: not overlapped with compute)."""
        swapped = len(out.blocks_to_swap_out) + len(out.blocks_to_swap_in)
        blocks = swapped + len(out.blocks_to_store) + len(out.blocks_to_load)
        if not blocks:
            return 0.0
        self.swapped_blocks += swapped
        return self.cost.swap_time(blocks, self.config.block_size)

    # ---- observation -----------------------------------------------------------------------------------------
    def snapshot(self, stats: StepStats) -> Snapshot:
        """The state after the step ``stats`` describes (with the pool when ``snapshot_pool``)."""
        done = self.num_finished + self.num_rejected
        values = self._categories()
        snap = Snapshot(self.iteration, self.time, dict(zip(COLUMNS, row(stats, values, self.num_preemptions,
                                                                          self._prefix_cache_hits()))),
                        stats, progress=done / max(1, len(self.owned)))
        if not self.snapshot_pool:
            return snap
        self.scheduler.sync_all()
        self.policy.describe_pool(snap, self.running)
        return snap

    def _result(self) -> SimResult:
        requests = pd.DataFrame({"arrival_s": self.workload.arrival_s, "prompt_tokens": self.workload.prompt_tokens,
                                 "output_tokens": counted_tokens(self.workload.sample_output_tokens
                                                                 if self.workload.sample_output_tokens is not None
                                                                 else self.workload.output_tokens),
                                 "rejected": np.array(self.rejected, dtype=bool),
                                 "first_token_s": np.array(self.first_token_time, dtype=np.float64),
                                 "finish_s": np.array(self.finish_time, dtype=np.float64),
                                 "first_token_step_s": np.array(self.first_step_start, dtype=np.float64),
                                 "preemptions": np.array([self.scheduler.preemptions_of.get(request, 0)
                                                          for request in range(self.num_requests)], dtype=np.int64)})
        if len(self.owned) != self.num_requests:  # a replica: its own requests (index = request id)
            requests = requests.iloc[self.owned]
        summary = {"allocator": self.config.allocator, "block_size": self.config.block_size
                   if self.config.allocator == "paged" else np.nan, "kv_cache_dtype": self.config.kv_cache_dtype,
                   "capacity_tokens": self.policy.capacity,
                   "host_capacity_tokens": self.policy.host_capacity_tokens(),
                   **self.metrics.summary(), **latency_summary(requests),
                   "num_requests": len(self.owned), "num_requests_completed": self.num_finished,
                   "num_requests_rejected": self.num_rejected,
                   "rejection_reasons": format_rejections(self.rejection_reasons),
                   "preemptions": self.num_preemptions, "swap_outs": self.scheduler.num_swaps_out,
                   "blocks_swapped": self.swapped_blocks,
                   "generated_tokens": self.generated_tokens, "iterations": self.iteration,
                   "simulated_time_s": self.time, "bytes_copied": self.copied_tokens
                   * self.cost.model.kv_bytes_per_token, "stopped_early": self.stopped,
                   "kv_capacity_gib": self.policy.capacity * self.cost.model.kv_bytes_per_token / GiB}
        summary["throughput_tok_s"] = self.generated_tokens / self.time if self.time > 0 else 0.0
        summary["throughput_req_s"] = self.num_finished / self.time if self.time > 0 else 0.0
        if self.profile is not None:  # where the step prices left the profile's measured range ("" if nowhere)
            summary["profile_extrapolation"] = self.profile.beyond_measured(self.profile_highest)
        totals = self.metrics.totals()
        tier = self.policy.offload_stats()
        if tier is not None:
            totals["offload_hit_blocks"] = tier.hit_blocks
            queried = self.policy.prefix_cache_stats().queried_blocks
            summary.update(offload_hit_rate=tier.hit_blocks / queried if queried else 0.0,
                           offload_loaded_blocks=tier.loaded_blocks, offload_stored_blocks=tier.stored_blocks,
                           host_tier_peak_blocks=tier.peak_blocks)
        stats = self.policy.prefix_cache_stats()
        if stats is not None:
            totals.update(prefix_cache_hit_blocks=stats.hit_blocks, prefix_cache_queried_blocks=stats.queried_blocks)
            caching = self.config.enable_prefix_caching  # off: no rate to report (NaN, as for contiguous runs)
            summary["prefix_cache_hit_rate"] = stats.hit_rate if caching else math.nan
            summary["prefix_cache_hit_blocks"] = stats.hit_blocks if caching else math.nan
        steps = self.scheduler.step_log_frame() if self.config.record_steps else None
        return SimResult(summary, self.metrics.timeseries(), requests, self.config, steps, totals)
