"""The paged KV policy: the scheduler's view of ``KVBlockManager`` (and, for swapping, a host-memory pool).

The engine and the simulator use this same class. Decoding sequences need a block every ``block_size`` tokens: the
scheduler counts the sequences crossing a block boundary in a step and reserves that many blocks at once
(``reserve``); a sequence's tokens reach the manager lazily (``sync``: when it is released, preempted or swapped,
or every step when the engine needs its slots), taking its blocks from the reservation. Irregular needs (the
copy-on-write of a shared partial block, the first token after a swap-in) are events: ``grow``.
"""
from __future__ import annotations

from lab.kv_cache.block_manager import KVBlockManager, OutOfBlocksError, PrefixCacheStats
from lab.kv_cache.pool_view import pool_snapshot, tier_snapshot
from lab.kv_cache.offload import OffloadCopies
from .scheduler import NO_EVENT, MemoryNeeds, MemorySample, Sequence

DEFAULT_SWAP_SPACE_BYTES = 4 << 30  # vLLM's --swap-space default: 4 GiB of host memory per GPU


def default_num_cpu_blocks(num_blocks: int, block_bytes: int) -> int:
    """The host pool for swap preemption when no size is given: as many blocks as the device pool, but at most
    vLLM's default swap space (``DEFAULT_SWAP_SPACE_BYTES``) of ``block_bytes`` blocks. A device pool sized from a
    GPU's free memory would otherwise ask for as much pinned host memory (on an H200, more than its host has)."""
    return max(1, min(num_blocks, DEFAULT_SWAP_SPACE_BYTES // block_bytes))


def host_pool_blocks(num_cpu_blocks: int, offload_blocks: int | None, enable_prefix_caching: bool) -> int:
    """Blocks of the one host pool: the swap space plus a bounded offload tier's share (``lab.kv_cache.offload``: both draw
    on the whole pool, swapped sequences first). An unbounded tier (None) is a measuring device kept beside it."""
    tier = offload_blocks if enable_prefix_caching and offload_blocks else 0
    return num_cpu_blocks + tier


class PagedPolicy:
    """Fixed-size blocks from a ``KVBlockManager`` of ``num_blocks``; a host pool (a second manager with the same
    invariants) of ``num_cpu_blocks`` plus the offload tier's ``offload_blocks`` takes swapped-out sequences (with
    ``num_cpu_blocks > 0``) and lends the tier its slots."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_cpu_blocks: int = 0, offload_blocks: int | None = 0):
        self.block_size = self.block_period = block_size
        host_blocks = host_pool_blocks(num_cpu_blocks, offload_blocks, enable_prefix_caching)
        self.cpu_manager = KVBlockManager(host_blocks, block_size) if host_blocks > 0 else None
        self.manager = KVBlockManager(num_blocks, block_size, enable_prefix_caching, offload_blocks,
                                      self.cpu_manager if offload_blocks is not None else None)
        self.tier = self.manager.offload
        self.free_queue = self.manager.free_block_queue  # read on every step: the count of free blocks
        self.pending_copies = self.manager.pending_copies  # copy-on-write copies queued (the manager's own list)
        # reserve(count): take blocks for the sequences crossing a block boundary in this step, if that many are
        # free (the scheduler's per-step call with a bucket's size, bound to the manager without a wrapper)
        self.reserve = self.manager.try_reserve_counted_blocks
        self.reserves_by_count = self.tier is None  # a tier's reservation takes blocks now (stores evicted ones)
        self.num_swap_blocks = num_cpu_blocks
        self.supports_swap = num_cpu_blocks > 0
        self.caches_prefixes = enable_prefix_caching
        self.capacity = num_blocks * block_size
        self.never_filled = 0
        self.copied_tokens = 0  # KV tokens moved by growing a region (contiguous policies); paging never copies
        # Forks share a partly filled last block until they append: block -> holders, and the slots that counting
        # those extra holders as full blocks over-subtracts from the token states.
        self.shared_partial_holders: dict[int, int] = {}
        self.shared_partial_slack = 0

    # ---- admission ----------------------------------------------------------------------------------------------
    def can_ever_fit(self, final_len: int, count: int = 1) -> bool:
        return count * -(-final_len // self.block_size) <= self.manager.num_physical_blocks

    def can_ever_admit(self, prompt_len: int, final_len: int, count: int, first_decode: bool) -> bool:
        """Whether ``admit`` could take a group of ``count`` samples into an empty pool: its prompt's blocks and
        what its samples take at once (``_admission_extra``)."""
        blocks = -(-prompt_len // self.block_size) + self._admission_extra(prompt_len, final_len, count, first_decode)
        return blocks <= self.manager.num_physical_blocks

    def _admission_extra(self, prompt_len: int, final_len: int, count: int, first_decode: bool) -> int:
        """Blocks a group's admission takes besides its prompt's: with ``first_decode``, each sample's first decode
        block when the prompt ends on a block boundary, else a copy of the shared last block for each sample but
        one (copy-on-write); nothing when no sample decodes (``final_len == prompt_len``: one output token)."""
        if final_len <= prompt_len:
            return 0
        return count if first_decode and prompt_len % self.block_size == 0 else count - 1

    def admit(self, seqs: list[Sequence], token_ids: list[int] | None, first_decode: bool = True,
              chunk: int | None = None, whole_must_fit: bool = False) -> bool:
        """Allocate a group's prompt (the first sequence; the others fork it), if the prompt and, with
        ``first_decode``, the group's first decode step fit. All or nothing. vLLM V1 admits without the first decode's
        block and allocates for the tokens it schedules only (``KVCacheManager.allocate_slots``): with ``chunk`` (a
        group of one), only the cache hits and the next ``chunk`` prompt tokens get blocks now, ``grow`` gives a later
        chunk its own; ``whole_must_fit`` admits it only if the whole prompt's blocks are free now (vLLM's
        ``scheduler_reserve_full_isl``: ``allocate_slots(full_sequence_must_fit=True)``, hits counted as it counts
        them)."""
        first, manager = seqs[0], self.manager
        if chunk is not None and (self.tier is not None or len(first.group.seqs) > 1):
            chunk = None  # the whole prompt now: a tier stores whole prompts, a sample's stream is not its own
        prompt_len = first.prompt_len
        extra = self._admission_extra(prompt_len, first.final_len, len(seqs), first_decode)
        ids = token_ids if token_ids is not None and len(token_ids) == prompt_len else None
        count = None if ids is not None else prompt_len
        stream = first.group.stream_key if ids is None else None
        blocks = -(-prompt_len // self.block_size)  # its table: cache hits plus fresh blocks
        # Enough free blocks for the whole prompt is sufficient (hits only lower the need): skip the lookup.
        if (chunk is None or whole_must_fit) and blocks + extra > self.free_queue.num_free and \
                not manager.can_allocate(ids, count, extra, stream):
            return False
        # A stream's prompt blocks are cached as it is admitted, as the engine caches a prompt's: a cached block is
        # freed to the back of the free queue, an uncached one to the front, so both executors must cache the same.
        # A request of one sample whose stream is new here may leave it for later, block by block the same: only its
        # own later prefill can look its stream up, so its blocks are registered when it is preempted and, when it
        # finishes, freed as cached ones (release(end_stream=True)). Its admission and release then cost no work
        # per block (a sibling's recompute may ask at any time, a tier stores what is evicted: those register now).
        register = len(first.group.seqs) > 1 or self.tier is not None or \
            (stream is not None and manager.prefix_cache.has_stream(stream))
        try:
            if register or stream is None or chunk is not None or not self.caches_prefixes:
                first.cached_tokens = manager.create_sequence(first.seq_id, ids, count, stream, register, chunk)
            else:  # a new stream (no hit possible: ``register`` is false): the same, without the lookup
                manager.create_unseen_stream(first.seq_id, count, stream)
                first.cached_tokens = 0
        except OutOfBlocksError:  # only with a chunk: the check above has made sure of the rest
            return False
        first.synced_len = manager.sequences[first.seq_id].num_tokens
        blocks = -(-first.synced_len // self.block_size)
        if len(seqs) > 1:
            for seq in seqs[1:]:
                manager.fork_sequence(first.seq_id, seq.seq_id)
                seq.cached_tokens, seq.synced_len = 0, prompt_len
            self._track_shared_partial(seqs)
            for seq in seqs:
                self._count_final_block(seq, blocks)
        elif blocks * self.block_size >= first.final_len:  # else its final block is counted when it is reserved
            self._count_final_block(first, blocks)
        return True

    # ---- growth ---------------------------------------------------------------------------------------------------
    def memory_needs(self, seq: Sequence) -> MemoryNeeds:
        """For ``seq`` (synced): the KV length at which it needs a copy of the partly filled block it shares
        (an event), and the KV length from which it needs a new block every ``block_period`` tokens; ``NO_EVENT``
        for none (its blocks already hold ``final_len``)."""
        if seq.group.beam is not None:  # beams are re-forked every step: their memory is an event every step
            return MemoryNeeds(seq.synced_len + 1, NO_EVENT)
        # A shared partly filled last block comes from a fork (prefix-cache hits are full blocks), and
        # _track_shared_partial recorded it; the table holds the blocks of the synced tokens.
        if seq.shared_block >= 0 and self.manager.is_shared(seq.shared_block):
            return MemoryNeeds(seq.synced_len + 1, NO_EVENT)
        allocated = -(-seq.synced_len // self.block_size) * self.block_size
        return MemoryNeeds(NO_EVENT, allocated + 1 if allocated < seq.final_len else NO_EVENT)

    def final_block_reserved(self, seq: Sequence) -> int:
        """``seq``'s last periodic block was reserved: the slots past its final length will never be filled (how
        many it counts now)."""
        return self._count_final_block(seq, -(-seq.final_len // self.block_size))

    def grow(self, seq: Sequence, kv_len: int, alone: bool) -> bool:
        """Give ``seq`` (synced) fresh blocks for ``kv_len`` tokens (copy-on-write included; a prompt chunk's full
        blocks cached, as at admission); False (nothing changed) when too few blocks are free. A lone sequence always
        fits (``can_ever_fit``), so ``alone`` needs nothing special here."""
        manager, size = self.manager, self.block_size
        table = manager.sequences[seq.seq_id].block_table
        needed = -(-kv_len // size) - len(table)
        if seq.synced_len % size and manager.is_shared(table[-1]):
            needed += 1
        if needed > manager.num_free_blocks:
            return False
        token_ids, prompt_chunk = seq.group.token_ids, seq.synced_len < seq.prompt_len
        self._append(seq, kv_len, False, token_ids(seq, kv_len)[seq.synced_len:kv_len]
                     if prompt_chunk and token_ids is not None else None)  # known tokens: hashed as they are added
        if prompt_chunk and token_ids is None:  # a stream's, by position
            manager.extend_stream(seq.seq_id)
        if len(table) * size >= seq.final_len and not seq.final_block_counted:
            self._count_final_block(seq, len(table))
        return True

    def sync(self, seq: Sequence, kv_len: int) -> None:
        """Tell the manager about ``seq``'s tokens up to ``kv_len``; their blocks were reserved."""
        if kv_len > seq.synced_len:
            self._append(seq, kv_len, True)

    def sync_slots(self, seq: Sequence, kv_len: int) -> None:
        """``sync`` when the manager's table lacks the block of ``seq``'s token ``kv_len - 1`` (or a shared partly
        filled block must be copied first): the engine's per-step call, so that every decode token has its slot.
        The table then has exactly the blocks of ``kv_len`` tokens while the manager's token count may lag inside the
        last block (nothing reads it before the next ``sync``)."""
        size = self.block_size
        if seq.shared_block >= 0 or -(-kv_len // size) > -(-seq.synced_len // size):
            self._append(seq, kv_len, True)

    def _append(self, seq: Sequence, kv_len: int, from_reserved: bool, token_ids=None) -> None:
        if seq.shared_block >= 0:
            self._leave_shared_partial(seq)
        self.manager.append_tokens(seq.seq_id, kv_len - seq.synced_len, token_ids, from_reserved)
        seq.synced_len = kv_len

    def release(self, seq: Sequence, kv_len: int) -> None:
        """``seq`` finished: free its blocks, with those reserved for its tokens up to ``kv_len`` (never handed to
        it). A request of one sample frees its full blocks as cached ones, sampled tokens' included, as vLLM V1 caches
        a request's blocks as they fill (``KVCacheManager.allocate_slots`` → ``cache_blocks``): they are reused after
        the uncached ones (``FreeBlockQueue``), and a later prompt that repeats them hits them."""
        group = seq.group
        if len(group.seqs) == 1 and group.beam is None:
            if group.token_ids is None and seq.shared_block < 0 and \
                    self.manager.release_ending_stream(seq.seq_id, kv_len):  # the same in one call
                seq.synced_len = kv_len
                self._forget(seq)
                return
            self.sync(seq, kv_len)
            ids = group.token_ids(seq, kv_len) if group.token_ids is not None else None
            self.manager.register_blocks(seq.seq_id, ids, sampled=True, ending=True)
        self._free(seq, kv_len)

    def _free(self, seq: Sequence, kv_len: int) -> None:
        owed = 0
        if kv_len > seq.synced_len:
            if seq.shared_block >= 0:
                self.sync(seq, kv_len)
            else:
                owed = -(-kv_len // self.block_size) - -(-seq.synced_len // self.block_size)
        self._forget(seq)
        self.manager.release_sequence(seq.seq_id, owed, True)  # the stream ends unless preempt registered it

    def preempt(self, seq: Sequence, kv_len: int) -> None:
        """Release a sequence that will be prefilled again: its full blocks stay findable in the prefix cache, for a
        request of one sample those of its sampled tokens too (a sample of several: the prompt's only, since the
        simulator cannot know one sample's tokens from another's; docs/vllm.md)."""
        self.sync(seq, kv_len)  # the table then holds every block of its tokens (whatever views synced before)
        group = seq.group
        if len(group.seqs) == 1:
            ids = group.token_ids(seq, kv_len) if group.token_ids is not None else None
            self.manager.register_blocks(seq.seq_id, ids, sampled=True)
        else:
            self.manager.register_blocks(seq.seq_id)
        self._free(seq, kv_len)

    def take_copies(self) -> list[tuple[int, int]]:
        return self.manager.take_pending_copies()

    @property
    def pending_offload(self) -> bool:
        """Whether the offload tier has copies queued (the scheduler asks once per step: without a tier, never)."""
        return self.tier is not None and self.manager.prefix_cache.has_tier_copies

    def take_offload_copies(self) -> OffloadCopies:
        return self.manager.take_offload_copies()

    def offload_stats(self):
        """The offload tier's ``OffloadStats`` (None without a tier)."""
        return self.tier.stats if self.tier is not None else None

    def refork(self, parent: Sequence, child: Sequence, kv_len: int) -> None:
        """Beam search: ``child`` drops its blocks and becomes a fork of ``parent`` (both hold ``kv_len - 1`` tokens;
        every block is shared, a shared partly filled block is copied on write when they append)."""
        self._forget(child)
        self.manager.release_sequence(child.seq_id)
        self.manager.fork_sequence(parent.seq_id, child.seq_id)
        child.synced_len = parent.synced_len
        blocks = len(self.manager.sequences[child.seq_id].block_table)
        self._track_shared_partial([child] if parent.shared_block >= 0 else [parent, child])
        self._count_final_block(child, blocks)

    # ---- swapping -------------------------------------------------------------------------------------------------
    def can_swap_out(self, seqs: list[Sequence], kv_lens: list[int]) -> bool:
        """Whether the host pool takes the sequences now and the device pool could ever take them back: their blocks
        plus the blocks of their next token must fit an empty device pool (else swapping them out would park them
        forever; the scheduler recomputes instead)."""
        manager, ids = self.manager, [s.seq_id for s in seqs]
        if not self.supports_swap or not manager.can_move_sequences(ids, self.cpu_manager, -self._tier_evictable()):
            return False
        next_token = sum(manager.num_blocks_to_append(s.seq_id, max(0, k + 1 - s.synced_len))
                         for s, k in zip(seqs, kv_lens))
        return manager.num_distinct_blocks(ids) + next_token <= manager.num_physical_blocks

    def swap_out(self, seqs: list[Sequence], kv_lens: list[int]) -> list[tuple[int, int]]:
        """Move the sequences to the host pool; returns ``(gpu block, cpu block)`` copies. A block that got a
        copy-on-write earlier in this step is read from its source (the copy has not run yet)."""
        manager = self.manager
        for seq, kv_len in zip(seqs, kv_lens):
            manager.register_blocks(seq.seq_id)  # the GPU blocks stay cached after the move
            self.sync(seq, kv_len)
            self._forget(seq)
        ids = [s.seq_id for s in seqs]
        shortfall = manager.num_distinct_blocks(ids) - self.cpu_manager.num_free_blocks
        if shortfall > 0:  # one host budget: the tier's least recently used entries make room
            self.tier.make_room(shortfall)
        mapping = manager.move_sequences(ids, self.cpu_manager)
        pending = {dst: src for src, dst in manager.pending_copies}
        moved = {gpu for gpu, _ in mapping}
        manager.pending_copies[:] = [(src, dst) for src, dst in manager.pending_copies if dst not in moved]
        return [(pending.get(gpu, gpu), cpu) for gpu, cpu in mapping]

    def first_decode_blocks(self, seqs: list[Sequence]) -> int:
        """Blocks the swapped sequences' next decode token needs (new blocks, copy-on-write)."""
        cpu = self.cpu_manager
        return sum(cpu.num_blocks_to_append(s.seq_id, s.kv_len_base + 1 - s.synced_len) for s in seqs)

    def can_swap_in(self, seqs: list[Sequence], extra_blocks: int) -> bool:
        return self.cpu_manager.can_move_sequences([s.seq_id for s in seqs], self.manager, extra_blocks)

    def swap_in(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        """Move the sequences back to the GPU pool; returns ``(cpu block, gpu block)`` copies."""
        mapping = self.cpu_manager.move_sequences([s.seq_id for s in seqs], self.manager)
        self._track_shared_partial(seqs)
        for seq in seqs:
            self._count_final_block(seq, len(self.manager.sequences[seq.seq_id].block_table))
        return mapping

    # ---- observation ----------------------------------------------------------------------------------------------
    def blocks_in_use(self) -> int:
        return self.manager.num_used_blocks

    def pool_snapshot(self):
        """The device pool (``PoolSnapshot``), with ``host_pool`` set when there is one; sync the sequences first
        (``Scheduler.sync_all``) so that reserved blocks show in their tables."""
        pool = pool_snapshot(self.manager)
        if self.supports_swap:
            pool.host_pool = pool_snapshot(self.cpu_manager)
        if self.tier is not None:
            pool.offload = tier_snapshot(self.tier)
            pool.offload.shares_host_pool = self.supports_swap and self.tier.host is not None
        return pool

    def cpu_blocks_in_use(self) -> int:
        """Host blocks of swapped-out sequences (the tier's slots aside)."""
        cpu = self.cpu_manager
        return cpu.num_used_blocks - len(cpu.lent) if cpu is not None else 0

    def tier_blocks_in_use(self) -> int:
        return len(self.tier) if self.tier is not None else 0

    def num_free_blocks(self) -> int:
        return self.manager.num_free_blocks

    @property
    def num_host_blocks(self) -> int:
        """Blocks of the host pool (swap space and a bounded tier together; 0: none)."""
        return 0 if self.cpu_manager is None else self.cpu_manager.num_physical_blocks

    def host_capacity_tokens(self) -> int:
        return self.num_host_blocks * self.block_size

    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self.manager.prefix_cache_stats

    def describe_pool(self, snapshot, running: dict) -> None:
        """The pool's blocks (``pool_snapshot``; the scheduler has synced the sequences)."""
        snapshot.pool = self.pool_snapshot()

    def memory_sample(self, held_tokens: int) -> MemorySample:
        """The categories in slots (no external fragmentation: any free block serves) and the token slots of every
        sequence's block table, a shared block counted once per holder (what the same sequences would hold without
        sharing). ``held_tokens`` counts every holder's tokens; shared full blocks are stored once, so their extra
        holders are subtracted."""
        size, capacity, never_filled = self.block_size, self.capacity, self.never_filled
        allocated = capacity - self.free_queue.num_free * size
        table_slots = self.manager.num_block_references * size
        token_states = held_tokens - table_slots + allocated + self.shared_partial_slack
        return MemorySample(token_states, allocated - never_filled - token_states, never_filled, 0,
                            capacity - allocated, table_slots)

    # ---- internals ------------------------------------------------------------------------------------------------
    def _tier_evictable(self) -> int:
        """Host blocks the tier gives up to a swap-out (0 without a tier that borrows from the host pool)."""
        tier = self.tier
        return tier.num_evictable if tier is not None and tier.host is not None else 0

    def _track_shared_partial(self, seqs: list[Sequence]) -> None:
        """Count the partly filled blocks these (just placed) sequences share."""
        manager, size = self.manager, self.block_size
        for seq in seqs:
            fill = seq.synced_len % size
            block = manager.sequences[seq.seq_id].block_table[-1] if fill else -1
            if block >= 0 and manager.is_shared(block):
                seq.shared_block = block
                holders = self.shared_partial_holders.get(block, 0)
                if holders:
                    self.shared_partial_slack += size - fill
                self.shared_partial_holders[block] = holders + 1

    def _leave_shared_partial(self, seq: Sequence) -> None:
        block, seq.shared_block = seq.shared_block, -1
        holders = self.shared_partial_holders.pop(block) - 1
        if holders:
            self.shared_partial_holders[block] = holders
            self.shared_partial_slack -= self.block_size - seq.synced_len % self.block_size

    def _forget(self, seq: Sequence) -> None:
        """Drop ``seq`` from the GPU aggregates (before it is released or swapped out)."""
        if seq.shared_block >= 0:
            self._leave_shared_partial(seq)
        if seq.final_block_counted:
            self.never_filled -= seq.final_block_slack
            seq.final_block_counted = False

    def _count_final_block(self, seq: Sequence, blocks: int) -> int:
        """Count the slots past ``seq``'s final length in its last block as never filled, once it holds ``blocks``
        that reach it and has the last to itself (while forks share a partly filled last block, its tail counts as
        reserved); returns the slots counted now. ``seq.shared_block`` is cleared only when ``seq`` next syncs: a sibling that copied on write,
        finished or left the pool in between has left the block to ``seq`` alone already."""
        alone = seq.shared_block < 0 or not self.manager.is_shared(seq.shared_block)
        if not seq.final_block_counted and alone and blocks * self.block_size >= seq.final_len:
            seq.final_block_slack = blocks * self.block_size - seq.final_len
            self.never_filled += seq.final_block_slack
            seq.final_block_counted = True
            return seq.final_block_slack
        return 0
