"""The one scheduler of MiniPaged Lab: the engine runs its step plans with Qwen3, the simulator with a cost model.

It owns the waiting / running / swapped queues, FCFS admission under ``max_num_seqs`` and
``max_num_batched_tokens``, step composition (``prefill-first`` or ``chunked``), preemption (``recompute`` or
``swap``) and every call into the KV allocation policy (and so into ``KVBlockManager``). ``schedule()`` returns a
``SchedulerOutput``; the executor runs it, reports finished sequences with ``finish()`` and closes the step with
``end_step()``.

Conventions (vLLM's): a sequence's KV holds the tokens computed so far; a sampled token gets its slot at the decode
step that feeds it. A prompt of ``P`` tokens with ``O`` output tokens therefore holds at most ``P + O - 1`` KV tokens.
Running sequences' lengths are implicit (``kv_len_base + step - step_base``), so a decode step costs O(1) plus
its events. Paged memory is needed periodically: a sequence crosses a block boundary every ``block_size`` steps,
so decoding sequences sit in ``block_size`` phase buckets and a step reserves one block per sequence of its phase
with one call (one by one, preempting the newest, only when they do not all fit). Irregular needs (a copy-on-write,
a contiguous region overflow) go into a calendar keyed by decode step. The engine asks for ``sync_every_step`` and
then every running sequence's block table is brought up to date each step (it needs the slots); the decisions are
the same.
"""
from __future__ import annotations

import collections
import heapq
import itertools
import sys
from collections import deque
from enum import Enum
from dataclasses import dataclass, field, fields
from operator import attrgetter
from typing import NamedTuple, Protocol

from lab.errors import LabError
from lab.kv_cache.block_manager import PrefixCacheStats, TokenIds
from lab.kv_cache.offload import OffloadCopies, OffloadStats

SCHEDULING_MODES = ("prefill-first", "chunked", "vllm")
PREEMPTION_MODES = ("recompute", "swap")
NO_EVENT = 1 << 62  # a KV length no sequence reaches: "needs no more memory"
STEP_LOG_COLUMNS = ("step", "num_prefill_tokens", "num_decode_seqs", "num_running", "num_waiting", "num_swapped",
                    "blocks_in_use", "cpu_blocks_in_use", "tier_blocks_in_use", "num_preempted", "num_swapped_out",
                    "num_swapped_in", "num_finished", "num_offload_stored", "num_offload_loaded", "duration_s")


class SchedulerError(LabError):
    """A scheduler argument or request is invalid."""


class RequestRejectedError(SchedulerError):
    """A request can never be scheduled (too long, too many samples, larger than the KV pool); ``reason`` says
    which. Nothing was queued."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


@dataclass(slots=True)
class SchedulingSettings:
    """The scheduler's caps and modes as a person sets them, declared once: ``EngineConfig`` and ``SimConfig``
    extend it (the same names and defaults, vLLM's), and ``lab.cli.args.scheduler_options`` makes every command's
    flags from these fields and their ``help``."""

    max_num_seqs: int = field(default=256, metadata={
        "help": "most sequences running at once (continuous batching's cap)"})
    max_num_batched_tokens: int = field(default=8192, metadata={
        "help": "token budget per step (chunked: prompts longer than this are spread over steps)"})
    scheduling: str = field(default="prefill-first", metadata={
        "help": "chunked: decodes first, then prompt chunks up to the token budget; vllm: chunked as vLLM V1 admits "
                "(a prompt whose blocks fit, its first decode's block taken when it decodes: docs/vllm.md)",
        "choices": SCHEDULING_MODES})
    long_prefill_token_threshold: int = field(default=0, metadata={
        "help": "chunked and vllm: most prompt tokens one request takes per step while other requests run or wait "
                "(0: no cap; vLLM V1's long_prefill_token_threshold)",
        "applies": (lambda s: s.scheduling != "prefill-first",
                    "it caps prompt chunks: chunked and vllm scheduling, not prefill-first, which prefills whole "
                    "prompts")})
    scheduler_reserve_full_isl: bool = field(default=True, metadata={
        "help": "vllm: admit a request only when its whole prompt's blocks are free, not just its first chunk's "
                "(vLLM's scheduler_reserve_full_isl, on by default)",
        "applies": (lambda s: s.scheduling == "vllm",
                    "prefill-first and chunked always take a whole prompt's blocks when they admit it")})
    preemption_mode: str = field(default="recompute", metadata={
        "help": "swap: preempted sequences move to a host pool (paged)", "choices": PREEMPTION_MODES})
    num_cpu_blocks: int = field(default=0, metadata={
        "help": "host pool for swap (0: as large as the device pool, at most vLLM's default 4 GiB of swap space)",
        "applies": (lambda s: s.preemption_mode == "swap",
                    "it is the host pool swapped sequences go to, and recompute preemption swaps nothing")})


def moot_settings(settings) -> list[str]:
    """The fields of ``settings`` (any dataclass whose fields may declare ``metadata["applies"]``: a predicate on the
    settings and why) set away from their defaults where the other fields make them moot, each as ``name=value
    (why)``: what a config refuses instead of ignoring. One declaration per field serves every command and the API."""
    moot = []
    for f in fields(settings):
        applies = f.metadata.get("applies")
        value = getattr(settings, f.name)
        if applies is not None and value != f.default and not applies[0](settings):
            moot.append(f"{f.name}={value!r} ({applies[1]})")
    return moot


@dataclass(slots=True)
class SchedulerConfig(SchedulingSettings):
    """``SchedulingSettings`` and what the executor adds: the longest sequence, and how plans are made."""

    max_model_len: int = 1 << 30
    sync_every_step: bool = False
    track_longest: bool = True  # plans carry decode_max_kv_len (a step-time profile reads it)

    @classmethod
    def of(cls, settings: SchedulingSettings, **executor) -> "SchedulerConfig":
        """The scheduler's config from an ``EngineConfig`` or ``SimConfig`` (its ``SchedulingSettings`` fields) and
        the ``executor``'s own fields (``max_model_len``, ``sync_every_step``, ``track_longest``)."""
        shared = {f.name: getattr(settings, f.name) for f in fields(SchedulingSettings)}
        return cls(**shared, **executor)

    def check(self) -> None:
        """Raise ``SchedulerError`` naming the first field out of range."""
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SchedulerError(f"{name} must be an integer >= 1, got {value!r}")
        if self.scheduling not in SCHEDULING_MODES:
            raise SchedulerError(f"scheduling must be one of {', '.join(SCHEDULING_MODES)}; got {self.scheduling!r}")
        threshold = self.long_prefill_token_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
            raise SchedulerError(f"long_prefill_token_threshold must be an integer >= 0, got {threshold!r}")

        if not isinstance(self.scheduler_reserve_full_isl, bool):
            raise SchedulerError(f"scheduler_reserve_full_isl must be True or False, got {self.scheduler_reserve_full_isl!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise SchedulerError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}; "
                                 f"got {self.preemption_mode!r}")
        moot = moot_settings(self)
        if moot:
            raise SchedulerError(f"{moot[0]} would be ignored")


class SequenceStatus(Enum):
    """Where a sequence is in its life (``Sequence.status``)."""

    WAITING = "waiting"  # queued for its (next) prefill
    PREFILLING = "prefilling"  # its prompt chunks are being computed; forks wait for the last one
    PREFILLED = "prefilled"  # a fork whose parent's prompt is computed: it samples from the parent's last row
    RUNNING = "running"  # decoding
    SWAPPED = "swapped"  # preempted to the host pool
    FINISHED = "finished"


class Sequence:
    """One sample. ``prompt_len`` is what its (next) prefill covers: the prompt, or after a recompute preemption
    the prompt plus every token sampled so far. ``final_len`` is the most KV tokens it will hold (an upper bound when
    the executor does not know the output length). ``data`` belongs to the executor."""

    __slots__ = ("seq_id", "group", "sample", "prompt_len", "final_len", "kv_len_base", "step_base", "epoch",
                 "num_computed", "cached_tokens", "region", "synced_len", "final_block_counted", "final_block_slack",
                 "shared_block", "status", "phase", "periodic_first", "periodic_last", "boundary_pending", "admitted",
                 "data")

    def __init__(self, seq_id, group: "SequenceGroup", sample: int, prompt_len: int, final_len: int, data=None):
        self.seq_id, self.group, self.sample, self.data = seq_id, group, sample, data
        self.prompt_len, self.final_len = prompt_len, final_len
        self.kv_len_base = self.step_base = self.epoch = self.num_computed = self.cached_tokens = 0
        self.admitted = 0  # when it was last admitted (the scheduler's count): vLLM preempts the newest
        self.region, self.synced_len = None, 0
        self.final_block_counted, self.final_block_slack = False, 0
        self.shared_block = -1  # a partly filled block it shares with forks (paged accounting), else -1
        self.status = SequenceStatus.WAITING
        self.phase = -1  # its phase bucket while it needs periodic blocks, else -1
        self.periodic_first = self.periodic_last = -1  # decode steps of its first and last periodic block
        self.boundary_pending = False  # in the slow path: its block for this step is not reserved yet


class SequenceGroup:
    """The sequences of one request (``n`` samples) that are admitted together. ``token_ids(seq, length)`` returns
    the first ``length`` token ids of ``seq``'s token stream (prompt, then what it sampled) for prefix caching, or
    None when unknown; ``stream_key`` (when the token ids are None) says the stream's content is a function of
    (key, position) alone, which prefix caching can use without the tokens."""

    __slots__ = ("request_id", "seqs", "token_ids", "stream_key", "data", "beam", "stop_token_ids")

    def __init__(self, request_id, seqs: list[Sequence], token_ids=None, data=None, stream_key=None, beam=None,
                 stop_token_ids: frozenset = frozenset()):
        self.request_id, self.seqs, self.token_ids, self.data = request_id, seqs, token_ids, data
        self.stream_key = stream_key
        self.stop_token_ids = stop_token_ids  # a sampled one finishes the sequence (``Scheduler.postprocess``)
        # A beam search (a ``BeamModel``): the sequences are its beams. None: independent samples.
        self.beam = beam


class BeamModel(Protocol):
    """Who chooses a beam search's surviving beams: the engine's ranking (``lab.engine.beam.BeamRanking``) or the
    simulator's seeded model (``simulator.core.beams.BeamSurvival``). The scheduler asks it at each decode step of the
    group, before the step's tokens."""

    def parent_counts(self, live: list[Sequence]) -> list[int]: ...  # next beams continuing each live beam
    def forked(self, parent: Sequence, children: list[Sequence]) -> None: ...  # parent goes on as itself + children
    def restart(self, seqs: list[Sequence]) -> None: ...  # recompute preemption: the search starts again


@dataclass(slots=True)
class PrefillChunk:
    """``num_tokens`` prompt tokens of ``seq`` from position ``start`` (``start`` includes cached tokens).
    ``samples``: the sequences that sample their first token from this chunk's last position (the chunk completes
    the prompt; a group's forks share it), else empty."""

    seq: Sequence
    start: int
    num_tokens: int
    samples: list = field(default_factory=list)


NOTHING: tuple = ()  # an empty list field of a SchedulerOutput (most steps add nothing to most of them)


@dataclass(slots=True)
class SchedulerOutput:
    """One step's plan: what the executor runs, in this order: swap-out, swap-in, copy-on-write copies and the offload
    tier's copies, then the forward over the prefill chunks and the decoding sequences. The list fields are ``()``
    until the scheduler adds to them (``_extended``): most steps have no preemption, swap or copy, and the simulator
    makes one plan per step."""

    step: int  # the step's number (the scheduler's ``num_steps`` after it)
    num_prefill_tokens: int = 0  # prompt tokens computed this step (all chunks)
    num_decode_seqs: int = 0  # sequences that decode one token this step
    decode_seqs: list[Sequence] | None = None  # those sequences; only with ``sync_every_step`` (the engine)
    decode_kv_tokens: int = 0  # KV tokens the decoding sequences attend to, summed
    decode_max_kv_len: int = 0  # the longest of them (a padded batch's width)
    prefill_attention_pairs: float = 0.0  # (query, key) pairs the prefill chunks' attention computes
    cached_tokens_read: int = 0  # KV tokens of earlier chunks and prefix-cache hits that the chunks read
    prefill_chunks: list[PrefillChunk] | tuple = NOTHING  # the prompt chunks to compute
    prefill_done: list[Sequence] | tuple = NOTHING  # prompts fully computed: they sample their first token
    blocks_to_swap_out: list[tuple[int, int]] | tuple = NOTHING  # (device block, host block)
    blocks_to_swap_in: list[tuple[int, int]] | tuple = NOTHING  # (host block, device block)
    blocks_to_copy: list[tuple[int, int]] | tuple = NOTHING  # copy-on-write (source, destination) on the device
    blocks_to_store: list[tuple[int, int]] | tuple = NOTHING  # offload tier stores (device block, host slot)
    blocks_to_load: list[tuple[int, int]] | tuple = NOTHING  # offload tier loads (host slot, device block)
    preempted: list[Sequence] | tuple = NOTHING  # preempted by recompute: back to waiting, their KV freed
    swapped_out: list[Sequence] | tuple = NOTHING  # preempted by swapping their blocks to the host
    swapped_in: list[Sequence] | tuple = NOTHING  # brought back from the host this step
    finished: list[Sequence] | tuple = NOTHING  # finished this step (``Scheduler.finish``)

    @property
    def is_empty(self) -> bool:
        return not (self.num_prefill_tokens or self.num_decode_seqs or self.prefill_done)


def _admission_order(seq: Sequence) -> int:
    return seq.admitted


def _extended(items: list | tuple, more) -> list:
    """A plan's list field with ``more`` appended (in place once it is a list)."""
    if items is NOTHING:
        return list(more)
    items.extend(more)
    return items


@dataclass(slots=True)
class StepStats:
    """What one step did: the step-log columns (``STEP_LOG_COLUMNS``) plus running totals for dashboards. The
    engine and the simulator both emit it."""

    step: int
    num_prefill_tokens: int
    num_decode_seqs: int
    num_running: int
    num_waiting: int
    num_swapped: int
    blocks_in_use: int
    cpu_blocks_in_use: int  # host blocks of swapped-out sequences
    tier_blocks_in_use: int  # host slots the offload tier holds (the same host budget)
    num_preempted: int
    num_swapped_out: int
    num_swapped_in: int
    num_finished: int
    num_offload_stored: int
    num_offload_loaded: int
    duration_s: float
    elapsed_s: float = 0.0
    generated_tokens: int = 0
    num_free_blocks: int = 0
    peak_memory_bytes: int = 0


_step_log_row = attrgetter(*STEP_LOG_COLUMNS)


@dataclass(slots=True)
class MemorySample:
    """Where a policy's KV slots are at one moment (the simulator's memory categories, in token slots), and the
    slots the sequences' tables name (a shared block once per holder: what they would hold without sharing)."""

    token_states: int
    reserved: int
    internal_fragmentation: int
    external_fragmentation: int
    free: int
    table_slots: int

    def categories(self) -> tuple[int, int, int, int, int]:
        """The five categories in ``simulator.core.metrics.CATEGORIES`` order."""
        return (self.token_states, self.reserved, self.internal_fragmentation, self.external_fragmentation,
                self.free)


class MemoryNeeds(NamedTuple):
    """When a sequence next needs KV memory beyond what it holds (``KVPolicy.memory_needs``; ``NO_EVENT``: never)."""

    event_len: int  # the KV length at which it needs memory once (a copy-on-write, a region that overflows)
    periodic_from: int  # the KV length from which it needs a new block every ``block_size`` tokens


class KVPolicy(Protocol):
    """Where sequences' KV lives: the paged block manager (``lab.sched.kv_policy.PagedPolicy``) or a contiguous allocator
    (the simulator's baselines). One signature per operation; ``kv_len`` is the KV tokens the sequence holds."""

    capacity: int  # token slots
    supports_swap: bool  # swap_out / swap_in / can_swap_* / first_decode_blocks work (a host pool is there)
    caches_prefixes: bool  # admit() looks prompts up in a prefix cache (it wants their token ids)
    copied_tokens: int  # KV tokens copied within the device so far (grow-by-copy)
    block_period: int  # tokens between periodic needs (a block each), 0 for none
    pending_copies: list  # copy-on-write (src, dst) block copies not yet taken (an empty sequence when none)
    pending_offload: bool  # the offload tier has copies queued (take_offload_copies)

    def can_ever_fit(self, final_len: int, count: int = 1) -> bool: ...  # count sequences at once, sharing nothing
    def can_ever_admit(self, prompt_len: int, final_len: int, count: int, first_decode: bool) -> bool: ...
    def admit(self, seqs: list[Sequence], token_ids: list[int] | None, first_decode: bool = True,
              chunk: int | None = None, whole_must_fit: bool = False) -> bool: ...
    def memory_needs(self, seq: Sequence) -> MemoryNeeds: ...
    def reserve(self, count: int) -> bool: ...
    reserves_by_count: bool  # reserve(a + b) does what reserve(a) then reserve(b) does (no other effect)
    def final_block_reserved(self, seq: Sequence) -> int: ...  # the slots it now counts as never filled
    def grow(self, seq: Sequence, kv_len: int, alone: bool) -> bool: ...
    def sync(self, seq: Sequence, kv_len: int) -> None: ...
    def sync_slots(self, seq: Sequence, kv_len: int) -> None: ...  # sync what the slot of token kv_len - 1 needs
    def release(self, seq: Sequence, kv_len: int) -> None: ...
    def preempt(self, seq: Sequence, kv_len: int) -> None: ...
    def blocks_in_use(self) -> int: ...
    def cpu_blocks_in_use(self) -> int: ...
    def tier_blocks_in_use(self) -> int: ...  # host slots the offload tier holds (0: none)
    def num_free_blocks(self) -> int: ...
    def can_swap_out(self, seqs: list[Sequence], kv_lens: list[int]) -> bool: ...
    def swap_out(self, seqs: list[Sequence], kv_lens: list[int]) -> list[tuple[int, int]]: ...
    def can_swap_in(self, seqs: list[Sequence], extra_blocks: int) -> bool: ...
    def swap_in(self, seqs: list[Sequence]) -> list[tuple[int, int]]: ...
    def take_copies(self) -> list[tuple[int, int]]: ...
    def memory_sample(self, held_tokens: int) -> MemorySample: ...
    def host_capacity_tokens(self) -> int: ...  # slots of the host pool swapped sequences go to (0: none)
    def prefix_cache_stats(self) -> "PrefixCacheStats | None": ...  # None: the policy has no prefix cache
    def take_offload_copies(self) -> OffloadCopies: ...  # the tier's copies queued since the last call
    def offload_stats(self) -> "OffloadStats | None": ...  # None: no offload tier
    def describe_pool(self, snapshot, running: dict) -> None: ...  # put the pool's picture on a Snapshot
    def refork(self, parent: Sequence, child: Sequence, kv_len: int) -> None: ...
    def first_decode_blocks(self, seqs: list[Sequence]) -> int: ...


class Scheduler:
    """FCFS continuous batching over one ``KVPolicy``; see the module docstring for the protocol."""

    def __init__(self, config: SchedulerConfig, policy: KVPolicy):
        config.check()
        if config.preemption_mode == "swap" and not policy.supports_swap:
            raise SchedulerError("preemption_mode='swap' needs a policy with a host pool (the paged allocator with "
                                 "num_cpu_blocks > 0)")
        self.config, self.policy = config, policy
        self.waiting: deque[SequenceGroup] = deque()
        self.running: dict[object, Sequence] = {}  # decoding, in admission order: the last one is the newest
        self.prefilling: list[Sequence] = []  # chunked: admitted, prompt not fully computed
        self.swapped: deque[list[Sequence]] = deque()
        self.step = 0  # decode steps so far
        self.num_steps = 0
        # decode step -> [(seq, epoch)] needing memory then (an irregular need: a shared block's copy, a beam's)
        self.memory_calendar: dict[int, list] = {}
        self.periodic_ends: dict[int, list] = {}  # decode step -> sequences whose last periodic block it reserves
        self.period = policy.block_period
        self.phase_buckets: list[dict] = [{} for _ in range(self.period)]  # step % period -> {seq_id: seq}
        self.bucket_sizes = [0] * self.period  # len of each phase bucket
        self.bucket_total = 0  # blocks the buckets take per period
        self.len_offset = 0  # sum over running of (kv_len_base - step_base)
        self.len_offset_heap: list[tuple] = []  # (-(kv_len_base - step_base), tie, epoch, seq); stale ones lazily
        self._heap_ties = itertools.count()
        self.num_waiting_seqs = self.num_swapped_seqs = 0
        self.num_preemptions = self.num_swaps_out = 0
        self.preemptions_of: collections.Counter = collections.Counter()  # request id -> its preemptions
        self.num_admitted = 0  # groups admitted so far (``Sequence.admitted``)
        # (head group, its first chunk, free blocks) when the queue's head could not be admitted, until memory may have
        # come free: with no release since and no more free blocks, admitting it would fail again (a pool that only
        # fills cannot take it), so the step skips the attempt (the simulator offers a blocked head every step)
        self._blocked_head: tuple | None = None
        self.num_discarded_tokens = 0  # sampled tokens a restarted beam search threw away
        self.beam_groups: dict[SequenceGroup, None] = {}  # beam searches with beams decoding, in admission order
        self.step_rows: list[tuple] | None = None
        self._output: SchedulerOutput | None = None
        self._head_token_ids: tuple = (None, 0, None)  # (group, length, TokenIds) of the last group offered

    # ---- requests -----------------------------------------------------------------------------------------------
    def check_request(self, prompt_len: int, max_output_len: int, n: int, beams: bool = False) -> None:
        """Raise ``RequestRejectedError`` when such a request (``n`` samples, or ``n`` beams) could never be
        scheduled."""
        total = prompt_len + max_output_len
        if n > self.config.max_num_seqs:
            raise RequestRejectedError(f"n={n} samples exceed max_num_seqs={self.config.max_num_seqs}", "n")
        if total > self.config.max_model_len:
            raise RequestRejectedError(f"prompt ({prompt_len}) + output ({max_output_len}) = {total} tokens exceed "
                                       f"max_model_len {self.config.max_model_len}", "max_model_len")
        if not self.policy.can_ever_fit(total - 1):
            raise RequestRejectedError(f"a sequence of {total - 1} KV tokens does not fit the KV pool of "
                                       f"{self.policy.capacity} token slots", "capacity")
        if not beams and not self.policy.can_ever_admit(prompt_len, total - 1, n, self.config.scheduling != "vllm"):
            raise RequestRejectedError(f"its {n} samples of a {prompt_len}-token prompt cannot be admitted together "
                                       f"into the KV pool of {self.policy.capacity} token slots (a request's samples "
                                       f"start at once)", "capacity")
        if beams and not self.policy.can_ever_fit(total - 1, n):
            raise RequestRejectedError(f"{n} beams of {total - 1} KV tokens may not fit the KV pool of "
                                       f"{self.policy.capacity} token slots together (a preempted beam search "
                                       f"restarts whole, so its beams must fit at once)", "capacity")

    def add(self, group: SequenceGroup) -> None:
        """Queue a group (its sequences in ``waiting`` status); call ``check_request`` first."""
        self.waiting.append(group)
        self.num_waiting_seqs += len(group.seqs)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling or self.swapped)

    @property
    def num_running_seqs(self) -> int:
        """Sequences in the batch: decoding, and (chunked) admitted with their prompt partly computed."""
        return len(self.running) + len(self.prefilling)

    def held_tokens(self) -> int:
        """KV tokens of running and prefilling sequences on the GPU (a shared block counted once per holder)."""
        tokens = self.len_offset + len(self.running) * self.step
        if self.prefilling:
            tokens += sum(s.num_computed for s in self.prefilling)
        return tokens

    def kv_len(self, seq: Sequence) -> int:
        """KV tokens a running sequence holds now."""
        return seq.kv_len_base + self.step - seq.step_base

    # ---- one step -----------------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Plan the next step; allocates everything it needs (so executing the plan cannot run out of memory)."""
        out = self._output = SchedulerOutput(self.num_steps + 1)
        if self.config.scheduling != "prefill-first":  # chunked, vllm
            self._schedule_decode(out)
            if self.waiting or self.prefilling:
                self._schedule_prefills(out, self.config.max_num_batched_tokens - out.num_decode_seqs)
        else:
            if self.waiting and not self.swapped:
                self._schedule_prefills(out, self.config.max_num_batched_tokens)
            if not out.prefill_chunks:
                self._schedule_decode(out)
        if self.policy.pending_copies:
            out.blocks_to_copy = self.policy.take_copies()
        if self.policy.pending_offload:
            out.blocks_to_store, out.blocks_to_load = self.policy.take_offload_copies()
        if out.prefill_done:
            for seq in out.prefill_done:
                self._start_decoding(seq)
        return out

    def finish(self, seq: Sequence) -> None:
        """The executor says ``seq`` is done (its last token was sampled in this step): free its memory."""
        if self.running.get(seq.seq_id) is not seq:
            raise SchedulerError(f"sequence {seq.seq_id!r} is not running")
        self._leave_running(seq, self.kv_len(seq))
        seq.status = SequenceStatus.FINISHED
        out = self._output
        if out is not None:
            out.finished = _extended(out.finished, (seq,))

    def postprocess(self, sampled: list[tuple[Sequence, int]]) -> list[Sequence]:
        """The executor sampled ``(sequence, token)``: finish each sequence whose token is one of its group's stop
        tokens or that reached its final length (its last output token); returns them."""
        finished = []
        for seq, token in sampled:
            if token in seq.group.stop_token_ids or self.kv_len(seq) >= seq.final_len:
                self.finish(seq)
                finished.append(seq)
        return finished

    def end_step(self, duration_s: float, elapsed_s: float = 0.0, generated_tokens: int = 0,
                 peak_memory_bytes: int = 0, want_stats: bool = True) -> StepStats | None:
        """Close the step: count it and return (and log, when ``step_rows`` is a list) its ``StepStats``; with
        ``want_stats=False`` and no log, only count it (the simulator's fast path)."""
        out = self._output
        self.num_steps += 1
        if not want_stats and self.step_rows is None:
            return None
        stats = self._stats(out, duration_s, elapsed_s, generated_tokens, peak_memory_bytes)
        if self.step_rows is not None:
            self.step_rows.append(_step_log_row(stats))
        return stats

    def _stats(self, out: SchedulerOutput, duration_s: float, elapsed_s: float, generated_tokens: int,
               peak_memory_bytes: int = 0) -> StepStats:
        return StepStats(out.step, out.num_prefill_tokens, out.num_decode_seqs,
                         self.num_running_seqs, self.num_waiting_seqs, self.num_swapped_seqs,
                         self.policy.blocks_in_use(), self.policy.cpu_blocks_in_use(),
                         self.policy.tier_blocks_in_use(), len(out.preempted),
                         len(out.swapped_out), len(out.swapped_in), len(out.finished), len(out.blocks_to_store),
                         len(out.blocks_to_load), duration_s, elapsed_s,
                         generated_tokens, self.policy.num_free_blocks(), peak_memory_bytes)

    # ---- quiet steps (the simulator's fast path) ----------------------------------------------------------------
    def quiet_decode_steps(self, limit: int) -> int:
        """How many of the next steps (at most ``limit``) are quiet: every running sequence decodes a token and
        nothing else happens (no prompt, admission, swap, beam step, irregular memory need, no copy pending, no step
        log) but block reservations that are sure to succeed and only count (``KVPolicy.reserves_by_count``: the
        blocks of every sequence crossing a boundary fit the free ones) and periodic ends (``settle_periodic_ends``).
        ``skip_quiet_steps`` then counts them without planning each."""
        step, period = self.step, self.period
        if (not self.running or self.prefilling or self.swapped or self.beam_groups or self.step_rows is not None
                or self.config.sync_every_step or self.policy.pending_copies or self.policy.pending_offload
                or self.waiting and not self._admits_nothing()):
            return 0
        steps = min(limit, min(self.memory_calendar) - step - 1) if self.memory_calendar else limit
        if period and steps > 0:
            steps = self._steps_reservable(steps)
        return max(steps, 0)

    def _steps_reservable(self, steps: int) -> int:
        """How many of the next ``steps`` steps get their phase buckets' blocks for sure: all of them while the
        blocks fit the free ones (a bucket recurs every period steps), else up to the first bucket that may not."""
        per_period, period = self.bucket_total, self.period
        if per_period == 0:
            return steps
        if not self.policy.reserves_by_count:
            sizes = self.quiet_bucket_sizes()
            return min(next((ahead for ahead, size in enumerate(sizes) if size), steps), steps)
        free = self.policy.num_free_blocks()
        if free >= (steps // period + 1) * per_period:
            return steps
        periods = min(free // per_period, steps // period)
        free -= periods * per_period
        ahead = periods * period
        for size in self.quiet_bucket_sizes():
            if ahead == steps or size > free:
                break
            free -= size
            ahead += 1
        return ahead

    def quiet_bucket_sizes(self) -> list[int]:
        """Blocks reserved by each of the next ``period`` steps if they are quiet (``[k]``: the step ``k + 1``
        ahead); the cycle repeats."""
        sizes, start = self.bucket_sizes, (self.step + 1) % self.period
        return sizes[start:] + sizes[:start]

    def _admits_nothing(self) -> bool:
        """With nothing prefilling or swapped: whether the next step admits nothing from ``waiting`` (the batch is
        full, or the head is known not to fit), as ``_schedule_prefills`` decides."""
        head = self.waiting[0]
        if len(self.running) + len(head.seqs) > self.config.max_num_seqs:
            return True
        if self.config.scheduling == "prefill-first":
            return self._admission_fails(head, None)
        budget = self.config.max_num_batched_tokens - len(self.running)
        if budget <= 0:
            return True
        vllm = self.config.scheduling == "vllm"
        return self._admission_fails(head, min(budget, self._prompt_cap()) if vllm and len(head.seqs) == 1 else None)

    def quiet_step_stats(self) -> StepStats:
        """The ``StepStats`` of the first of the quiet steps about to be skipped, but for its times and tokens
        (the later ones differ from it only in those and the step)."""
        return self._stats(SchedulerOutput(self.num_steps + 1, num_decode_seqs=len(self.running)), 0.0, 0.0, 0)

    def skip_quiet_steps(self, steps: int, count: int) -> None:
        """Count ``steps`` quiet steps (``quiet_decode_steps``) as run: each running sequence is ``steps`` tokens
        longer (``kv_len``), and ``count`` blocks, what their phase buckets take in those steps (the caller sums
        ``quiet_bucket_sizes`` over them), reserved at once (as many as one reservation per step takes). The caller
        has settled the periodic ends of those steps (``settle_periodic_ends``, step by step: the simulator weights
        what each settles by its step's time)."""
        if self.bucket_total:
            if count and not self.policy.reserve(count):
                raise RuntimeError(f"{steps} quiet steps need {count} blocks, {self.policy.num_free_blocks()} free "
                                   f"(quiet_decode_steps allowed more steps than the pool serves)")
        self.step += steps
        self.num_steps += steps

    def drop_unschedulable_head(self) -> SequenceGroup | None:
        """Nothing could run although work is queued: the queue head cannot be admitted even into an idle pool
        (``check_request`` makes this unreachable). Remove and return it so the caller can reject it. Raises
        ``RuntimeError`` when the stall has another cause (a scheduler bug: never spin silently)."""
        if self.waiting and not (self.running or self.prefilling or self.swapped):
            group = self.waiting.popleft()
            self.num_waiting_seqs -= len(group.seqs)
            return group
        if self.has_unfinished():
            raise RuntimeError(f"the scheduler made no progress: {len(self.running)} running, "
                               f"{len(self.prefilling)} prefilling, {self.num_swapped_seqs} swapped, "
                               f"{self.num_waiting_seqs} waiting, {self.policy.num_free_blocks()} free blocks")
        return None

    # ---- decode -------------------------------------------------------------------------------------------------
    def _schedule_decode(self, out: SchedulerOutput) -> None:
        if not (self.running or self.swapped):
            return
        self.step += 1
        self._reserve_decode_memory(out)
        if self.swapped and not out.preempted and not out.swapped_out:
            self._swap_in(out)
        if self.config.sync_every_step:
            kv_len, sync = self.kv_len, self.policy.sync_slots
            out.decode_seqs = list(self.running.values())
            for seq in out.decode_seqs:
                sync(seq, kv_len(seq))
        self._count_decodes(out)

    def _count_decodes(self, out: SchedulerOutput) -> None:
        """The plan's decode batch: the running sequences (again when a prompt chunk preempted one of them)."""
        if self.config.sync_every_step:
            out.decode_seqs = list(self.running.values())
        out.num_decode_seqs = len(self.running)
        out.decode_kv_tokens = self.len_offset + len(self.running) * self.step
        out.decode_max_kv_len = self._max_len_offset() + self.step if self.config.track_longest and self.running \
            else 0

    def _max_len_offset(self) -> int:
        """max over running of (kv_len_base - step_base): the longest sequence's length is this plus ``step``
        (backends that pad a decode batch to its longest sequence pay for it)."""
        heap, running = self.len_offset_heap, self.running
        while heap:
            _, _, epoch, seq = heap[0]
            if seq.epoch == epoch and running.get(seq.seq_id) is seq:
                return -heap[0][0]
            heapq.heappop(heap)
        return 0

    def _reserve_decode_memory(self, out: SchedulerOutput) -> None:
        """Reserve this decode step's blocks and process its events, preempting the newest sequences until they
        all fit."""
        step = self.step
        if self.beam_groups:
            for group in list(self.beam_groups):
                self._beam_step(group)
        if self.period:
            bucket = self.phase_buckets[step % self.period]
            if bucket and not self.policy.reserve(len(bucket)):
                self._reserve_one_by_one(bucket, out)
        if step in self.periodic_ends:
            self.settle_periodic_ends(step)
        if step not in self.memory_calendar:
            return
        self._blocked_head = None  # growth may move a region (contiguous) or copy a shared block
        running = self.running
        for seq, epoch in self.memory_calendar.pop(step):
            if seq.epoch != epoch or running.get(seq.seq_id) is not seq:
                continue
            kv_len = seq.kv_len_base + step - seq.step_base
            if self.policy.grow(seq, kv_len, False) or self._make_room(seq, kv_len, out):
                self._schedule_memory_event(seq)

    def settle_periodic_ends(self, step: int) -> int:
        """The sequences whose last periodic block step ``step`` reserves: the slots past their final lengths will
        never be filled (``KVPolicy.final_block_reserved``); returns how many slots that makes. A sequence keeps its
        bucket (it finishes before its phase comes round again), and leaving the running set removes it."""
        self._blocked_head = None
        settled, final_block_reserved = 0, self.policy.final_block_reserved
        for seq in self.periodic_ends.pop(step):
            if seq.periodic_last == step:  # else it left running since (a repeat is a no-op)
                settled += final_block_reserved(seq)
        return settled

    def _beam_step(self, group: SequenceGroup) -> None:
        """Before this step's tokens: a beam continued by ``c > 1`` of the next beams is forked ``c - 1`` times into
        the sequences of beams no candidate continues (``KVPolicy.refork``), and ``group.beam.forked`` learns which
        sequence continues which beam; the group's beams are re-ranked parents first, each followed by its forks.
        A beam left over (fewer next beams than live ones) leaves the batch."""
        self._blocked_head = None  # re-forking releases and takes blocks
        running, beam = self.running, group.beam
        live = self._running_of(group)
        if not live:
            del self.beam_groups[group]
            return
        counts, kv_len = beam.parent_counts(live), self.kv_len(live[0])
        released = [seq for seq, count in zip(live, counts) if count == 0]
        ranked = []
        for seq, count in zip(live, counts):
            if count:
                children = [released.pop() for _ in range(count - 1)]
                for child in children:  # the extra continuations take over released beams' sequences
                    self.policy.refork(seq, child, kv_len)
                beam.forked(seq, children)
                ranked += [seq, *children]
        for seq in released:
            self._leave_running(seq, kv_len - 1)
            seq.status = SequenceStatus.FINISHED
        group.seqs[:] = ranked + [seq for seq in group.seqs if running.get(seq.seq_id) is not seq]

    def _reserve_one_by_one(self, bucket: dict, out: SchedulerOutput) -> None:
        """Not every sequence of this phase gets its block: reserve in admission order, preempting the newest."""
        for seq in bucket.values():
            seq.boundary_pending = True
        for seq in list(bucket.values()):
            if not seq.boundary_pending:
                continue  # preempted meanwhile
            while not self.policy.reserve(1):
                if len(self.running) == 1 and not self.prefilling:
                    raise RuntimeError(f"sequence {seq.seq_id!r} alone cannot get a block (can_ever_fit was wrong)")
                self._preempt(self._newest(), out)
                if not seq.boundary_pending:
                    break
            else:
                seq.boundary_pending = False

    def _make_room(self, seq: Sequence, kv_len: int, out: SchedulerOutput) -> bool:
        """Preempt the newest sequences until ``seq`` can grow to ``kv_len``; False when ``seq`` itself was
        preempted."""
        running = self.running
        while True:
            if len(running) == 1 and not self.prefilling:  # alone: preempting itself could never help
                if not self.policy.grow(seq, kv_len, True):
                    raise RuntimeError(f"sequence {seq.seq_id!r} alone cannot grow (can_ever_fit was wrong)")
                return True
            self._preempt(self._newest(), out)
            if running.get(seq.seq_id) is not seq:
                return False
            if self.policy.grow(seq, kv_len, False):
                return True

    def _newest(self) -> Sequence:
        """The preemption victim: the newest running sequence; in vllm scheduling the newest admitted of the
        running and the partly prefilled ones (vLLM V1 preempts ``self.running[-1]``: its running queue holds both
        in the order they were admitted, where ours holds decoding sequences in the order their prefill ended)."""
        if self.config.scheduling != "vllm":
            return self.running[next(reversed(self.running))]
        newest = max(reversed(self.running.values()), key=_admission_order, default=None)  # ties: the last
        if self.prefilling and (newest is None or self.prefilling[-1].admitted > newest.admitted):
            return self.prefilling[-1]
        return newest

    def _preempt(self, victim: Sequence, out: SchedulerOutput) -> None:
        """Free the victim's GPU memory: swap its whole group's running sequences to the host pool, or (recompute,
        or no host room) drop its KV and queue it first to be prefilled again with everything it has sampled."""
        self.num_preemptions += 1
        self.preemptions_of[victim.group.request_id] += 1
        if victim.status is SequenceStatus.PREFILLING:  # vllm: its prompt starts over (its blocks stay cached)
            self._blocked_head = None
            self.prefilling.remove(victim)
            self.policy.preempt(victim, victim.num_computed)
            victim.num_computed, victim.status = 0, SequenceStatus.WAITING
            out.preempted = _extended(out.preempted, (victim,))
            self._requeue_alone(victim)
            return
        if self.config.preemption_mode == "swap":
            group = self._running_of(victim.group)
            kv_lens = [self.kv_len(s) - 1 for s in group]  # this step's token has no slot yet
            for seq in group:
                self._materialize(seq)
            if self.policy.can_swap_out(group, kv_lens):
                for seq, kv_len in zip(group, kv_lens):
                    self._leave_running(seq, kv_len, release=False)
                    seq.kv_len_base, seq.status = kv_len, SequenceStatus.SWAPPED
                out.blocks_to_swap_out = _extended(out.blocks_to_swap_out, self.policy.swap_out(group, kv_lens))
                out.swapped_out = _extended(out.swapped_out, group)
                self.swapped.append(group)
                self.num_swapped_seqs += len(group)
                self.num_swaps_out += 1
                return
        group = victim.group
        if group.beam is not None and not self._alone(group):
            self._restart_beam_search(group, out)
            return
        kv_len = self.kv_len(victim) - 1
        self._leave_running(victim, kv_len, release=False)
        self.policy.preempt(victim, kv_len)
        victim.prompt_len, victim.num_computed, victim.status = kv_len + 1, 0, SequenceStatus.WAITING
        out.preempted = _extended(out.preempted, (victim,))
        alone = self._requeue_alone(victim)
        if group.beam is not None:
            # A search alone in the batch cannot make room by restarting (a contiguous space too fragmented for all
            # its beams; ``check_request`` keeps a paged pool from ever getting here): its newest beam leaves it and
            # ends on its own, as a sample.
            group.seqs.remove(victim)
            victim.group = alone

    def _requeue_alone(self, victim: Sequence) -> SequenceGroup:
        """Queue a preempted sequence first, in a group of its own (a sample of several is recomputed alone)."""
        group = victim.group
        alone = SequenceGroup(group.request_id, [victim], group.token_ids, group.data, group.stream_key)
        self.waiting.appendleft(alone)
        self.num_waiting_seqs += 1
        return alone

    def _running_of(self, group: SequenceGroup) -> list[Sequence]:
        """``group``'s sequences in the running set, in the group's order."""
        running = self.running
        return [seq for seq in group.seqs if running.get(seq.seq_id) is seq]

    def _alone(self, group: SequenceGroup) -> bool:
        """Whether ``group``'s sequences are all the batch holds."""
        return not self.prefilling and len(self.running) == len(self._running_of(group))

    def _restart_beam_search(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        """Recompute preemption of a beam search: a beam's continuation depends on its siblings', so one beam
        cannot be recomputed alone. Every live beam drops its KV and the group waits first to be prefilled again
        from its prompt; ``group.beam.restart`` starts its ranking afresh."""
        live = self._running_of(group)
        for seq in live:
            kv_len = self.kv_len(seq) - 1
            self.num_discarded_tokens += kv_len + 1 - seq.prompt_len
            self._leave_running(seq, kv_len, release=False)
            self.policy.preempt(seq, kv_len)
        for seq in group.seqs:
            seq.num_computed, seq.status = 0, SequenceStatus.WAITING
        group.beam.restart(group.seqs)
        out.preempted = _extended(out.preempted, live)
        self.waiting.appendleft(group)
        self.num_waiting_seqs += len(group.seqs)

    def _swap_in(self, out: SchedulerOutput) -> None:
        """Bring swapped groups back FCFS while their blocks, their next token and the sequence cap fit."""
        while self.swapped:
            group = self.swapped[0]
            if len(self.running) + len(self.prefilling) + len(group) > self.config.max_num_seqs:
                return
            for seq in group:
                seq.step_base = self.step - 1  # resumes as if its last decode step was the previous one
            if not self.policy.can_swap_in(group, self.policy.first_decode_blocks(group)):
                return
            self.swapped.popleft()
            self.num_swapped_seqs -= len(group)
            out.blocks_to_swap_in = _extended(out.blocks_to_swap_in, self.policy.swap_in(group))
            for seq in group:
                seq.status = SequenceStatus.RUNNING
                self._enter_running(seq)
                kv_len = self.kv_len(seq)
                if min(self.policy.memory_needs(seq)) <= kv_len:
                    self.policy.grow(seq, kv_len, False)  # room was checked by can_swap_in
                self._schedule_memory_event(seq)
            out.swapped_in = _extended(out.swapped_in, group)

    # ---- prefill ------------------------------------------------------------------------------------------------
    def _schedule_prefills(self, out: SchedulerOutput, budget: int) -> None:
        """Continue partial prompts (chunked), then admit waiting groups FCFS while the sequence cap, the token
        budget and memory allow: whole prompts in prefill-first mode, budget-sized chunks in chunked mode (groups of
        n > 1 samples are prefilled whole)."""
        chunked = self.config.scheduling != "prefill-first"  # chunked, vllm
        vllm = self.config.scheduling == "vllm"  # blocks per chunk, as it schedules (else the prompt's at admission)
        cap = self._prompt_cap()
        if not self.prefilling and self.waiting:
            head = self.waiting[0]
            if self._admission_fails(head, min(budget, cap) if vllm and len(head.seqs) == 1 else None):
                return  # the queue's head still does not fit: nothing to do
        out.prefill_chunks, out.prefill_done = [], []
        for seq in list(self.prefilling):
            if budget <= 0:
                break
            if vllm:
                if seq.status is not SequenceStatus.PREFILLING:
                    continue  # preempted for an earlier one's chunk
                end = seq.num_computed + min(budget, cap, seq.prompt_len - seq.num_computed)
                decoding = len(self.running)
                grown = end <= seq.synced_len or self._grow_prompt(seq, end, out)
                if len(self.running) < decoding:  # a decode admitted after it went: vLLM had not scheduled it yet
                    budget += out.num_decode_seqs - len(self.running)
                    self._count_decodes(out)
                if not grown:
                    break  # preempted itself: vLLM schedules no later running request
            budget -= self._add_chunk(out, seq, min(budget, cap))
            if seq.num_computed >= seq.prompt_len:
                self.prefilling.remove(seq)
                out.prefill_done.append(seq)
                out.prefill_chunks[-1].samples = [seq]
        if self.swapped or vllm and out.preempted:  # vLLM admits nothing in a step that preempted
            return
        while self.waiting and budget > 0:
            group = self.waiting[0]
            seqs, prompt = group.seqs, group.seqs[0].prompt_len
            whole = not chunked or len(seqs) > 1
            occupied = len(self.running) + len(self.prefilling) + len(out.prefill_done)
            if occupied + len(seqs) > self.config.max_num_seqs:
                break
            if whole and out.prefill_chunks and prompt > budget:
                break
            chunk = min(budget, cap) if vllm and not whole else None
            if self._admission_fails(group, chunk):
                break
            ids = self._prompt_token_ids(group, prompt) if group.token_ids is not None else None
            if not self.policy.admit(seqs, ids, not vllm, chunk, vllm and self.config.scheduler_reserve_full_isl):
                self._blocked_head = (group, chunk, self.policy.num_free_blocks())
                break
            self.waiting.popleft()
            self.num_waiting_seqs -= len(seqs)
            self.num_admitted += 1
            for seq in seqs:
                seq.admitted = self.num_admitted
            parent = seqs[0]
            parent.num_computed = parent.cached_tokens
            out.cached_tokens_read += parent.cached_tokens
            budget -= self._add_chunk(out, parent, prompt if whole else min(budget, cap))
            if parent.num_computed >= prompt:
                for seq in seqs:
                    seq.num_computed = prompt
                    seq.status = SequenceStatus.PREFILLED
                out.prefill_done.extend(seqs)
                out.prefill_chunks[-1].samples = list(seqs)
            else:
                parent.status = SequenceStatus.PREFILLING
                self.prefilling.append(parent)

    def _admission_fails(self, group: SequenceGroup, chunk: int | None) -> bool:
        """Whether admitting ``group`` (with this first ``chunk``) is known to fail: it failed before, and no memory
        has come free since (``_blocked_head``)."""
        blocked = self._blocked_head
        return blocked is not None and blocked[0] is group and blocked[1] == chunk and \
            self.policy.num_free_blocks() <= blocked[2]

    def _grow_prompt(self, seq: Sequence, end: int, out: SchedulerOutput) -> bool:
        """vllm: blocks for ``seq``'s prompt up to ``end``, preempting the newest until they fit; False when ``seq``
        itself was preempted (``allocate_slots`` in the running loop of vllm/v1/core/sched/scheduler.py)."""
        self._blocked_head = None  # a chunk's blocks are cached as they are taken: the head may hit them
        while not self.policy.grow(seq, end, False):
            victim = self._newest()
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _prompt_cap(self) -> int:
        """The most prompt tokens one request takes this step: ``long_prefill_token_threshold`` while more than one
        request runs or waits, as ``Scheduler.schedule`` in vllm/v1/core/sched/scheduler.py counts them before it
        schedules (nobody to starve otherwise), else no cap."""
        threshold = self.config.long_prefill_token_threshold
        if threshold and len(self.running) + len(self.prefilling) + len(self.waiting) > 1:
            return threshold
        return sys.maxsize

    def _prompt_token_ids(self, group: SequenceGroup, prompt: int) -> TokenIds:
        """The group's prompt ids, built and checked once while it waits at the head of the queue for memory (it is
        offered every step, and a long prompt costs O(length) to build)."""
        if self._head_token_ids[0] is not group or self._head_token_ids[1] != prompt:
            self._head_token_ids = (group, prompt, TokenIds(group.token_ids(group.seqs[0], prompt)))
        return self._head_token_ids[2]

    @staticmethod
    def _add_chunk(out: SchedulerOutput, seq: Sequence, budget: int) -> int:
        start = seq.num_computed
        take = min(budget, seq.prompt_len - start)
        seq.num_computed = start + take
        out.prefill_chunks.append(PrefillChunk(seq, start, take))
        out.num_prefill_tokens += take
        out.prefill_attention_pairs += take * (2 * start + take + 1) / 2
        return take

    def _start_decoding(self, seq: Sequence) -> None:
        """Prefill done: the first token is sampled in this step; decoding starts at the next decode step."""
        seq.kv_len_base, seq.step_base, seq.status = seq.prompt_len, self.step, SequenceStatus.RUNNING
        self._enter_running(seq)
        self._schedule_memory_event(seq)

    # ---- bookkeeping --------------------------------------------------------------------------------------------
    def _enter_running(self, seq: Sequence) -> None:
        if seq.group.beam is not None:
            self.beam_groups[seq.group] = None
        self.running[seq.seq_id] = seq
        self.len_offset += seq.kv_len_base - seq.step_base
        if not self.config.track_longest:
            return
        heap = self.len_offset_heap
        heapq.heappush(heap, (seq.step_base - seq.kv_len_base, next(self._heap_ties), seq.epoch, seq))
        if len(heap) > 2 * len(self.running) + 64:  # stale entries buried below live ones: drop them (amortized O(1))
            running = self.running
            heap[:] = [e for e in heap if e[3].epoch == e[2] and running.get(e[3].seq_id) is e[3]]
            heapq.heapify(heap)

    def _leave_running(self, seq: Sequence, kv_len: int, release: bool = True) -> None:
        """Take ``seq`` off the running set; ``release`` frees its memory (else the caller preempts or swaps it, so
        its block table is completed first)."""
        self._blocked_head = None  # its memory comes free (or, preempted, its blocks may be hit)
        if not release:
            self._materialize(seq)
        if seq.phase >= 0:
            del self.phase_buckets[seq.phase][seq.seq_id]
            self.bucket_sizes[seq.phase] -= 1
            self.bucket_total -= 1
            seq.phase = -1
        seq.periodic_first = seq.periodic_last = -1
        seq.boundary_pending = False
        del self.running[seq.seq_id]
        self.len_offset -= seq.kv_len_base - seq.step_base
        seq.epoch += 1
        if release:
            self.policy.release(seq, kv_len)

    def _schedule_memory_event(self, seq: Sequence) -> None:
        """Put ``seq``'s next irregular memory need into the calendar, or else its periodic needs into a bucket."""
        position, start = self.policy.memory_needs(seq)
        if position <= seq.final_len:
            step = seq.step_base + position - seq.kv_len_base
            events = self.memory_calendar.get(step)
            if events is None:
                self.memory_calendar[step] = [(seq, seq.epoch)]
            else:
                events.append((seq, seq.epoch))
            return
        if start > seq.final_len:
            return
        first = seq.step_base + start - seq.kv_len_base
        last = first + (seq.final_len - start) // self.period * self.period
        seq.periodic_first, seq.periodic_last, seq.phase = first, last, first % self.period
        self.phase_buckets[seq.phase][seq.seq_id] = seq
        self.bucket_sizes[seq.phase] += 1
        self.bucket_total += 1
        ends = self.periodic_ends.get(last)
        if ends is None:
            self.periodic_ends[last] = [seq]
        else:
            ends.append(seq)

    def _reserved_len(self, seq: Sequence) -> int:
        """KV length that ``seq``'s blocks, reserved ones included, reach at its last periodic block so far (0 when
        none was reserved)."""
        first = seq.periodic_first
        if first < 0 or self.step < first:
            return 0
        at = first + (min(self.step, seq.periodic_last) - first) // self.period * self.period
        if at == self.step and seq.boundary_pending:
            at -= self.period
            if at < first:
                return 0
        return seq.kv_len_base + at - seq.step_base

    def _materialize(self, seq: Sequence) -> None:
        """Hand ``seq`` the blocks reserved for it so far (its block table is then complete)."""
        reached = self._reserved_len(seq)
        if reached > seq.synced_len:
            self.policy.sync(seq, reached)

    def sync_all(self) -> None:
        """Bring every running sequence's block table up to date (for views of the pool)."""
        for seq in self.running.values():
            self._materialize(seq)

    def step_log_frame(self):
        """The step log as a DataFrame with ``STEP_LOG_COLUMNS`` (empty when logging was off)."""
        import numpy as np
        import pandas as pd

        if not self.step_rows:
            return pd.DataFrame([], columns=list(STEP_LOG_COLUMNS))
        # column arrays, not rows: half the time of pandas' row conversion (the twin's simulator pays it every run)
        return pd.DataFrame(dict(zip(STEP_LOG_COLUMNS, map(np.array, zip(*self.step_rows)))))
