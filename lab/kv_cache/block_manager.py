"""The one KV block manager of MiniPaged Lab.

A fixed pool of physical blocks of ``block_size`` token slots, a block table per sequence, reference counts,
copy-on-write for forked sequences and (optionally) prefix caching of full blocks. Both the Qwen3 runtime and the
memory simulator drive this class; every operation on the hot path is O(1) per token and O(1) per block.

Prefix caching (which block holds which content) is ``lab.kv_cache.prefix_cache.PrefixCache``'s; this class asks it before
allocating a prompt, tells it as blocks fill, and evicts a cached block when the free queue hands it to a new owner.
A caller that does not have a prompt's tokens but knows its content is a function of (``stream_key``, position)
can pass ``stream_key`` instead.

Reference counts are stored for blocks that can have several holders. A block held by an *exclusive* sequence
(never forked, hit or cached) or reserved has exactly one holder, so its stored count stays 0 and its count of 1
is implicit: allocating and releasing such blocks writes no per-block count (the simulator's hot path).
``ref_counts`` adds the implicit ones back; ``is_shared`` reads the stored count.

Block tables, the free queue and the reserved blocks are C int arrays (``array('i')``), not lists of ints: taking,
appending and freeing a run of blocks copies memory instead of touching one int object per block.
``get_block_table`` returns a list.
"""
from __future__ import annotations

import numbers
from array import array
from collections import deque
from itertools import chain
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from lab.checks import check_bool, check_int
from lab.errors import InputError, LabError
from .offload import OffloadCopies, OffloadTier
from .prefix_cache import ROOT_CONTENT_ID, PrefixCache, PrefixCacheStats

MAX_POOL_BLOCKS = 2**31 - 1  # block ids are C ints
BLOCK_ID = "i"  # block tables, the free queue and reservations are C int arrays: no per-id object traffic
COMPACT_MIN = 4096  # the free queue drops its consumed entries once at least this many have piled up
ENDED_PRUNE_MIN = 64  # ... and its consumed ended-stream ranges once at least this many are kept


class BlockManagerError(LabError):
    """Base class of the block manager's errors."""


class OutOfBlocksError(BlockManagerError, RuntimeError):
    """Raised when an operation needs more free blocks than the pool has; the manager is left unchanged."""


class UnknownSequenceError(BlockManagerError, KeyError):
    """Raised for a sequence id the manager does not hold."""


class InvalidSequenceIdError(BlockManagerError, ValueError):
    """A sequence id is not hashable; the manager is left unchanged."""


class InvalidTokenError(BlockManagerError, ValueError):
    """A token id or count is not an integer; the manager is left unchanged."""


class BlockManagerConfigError(BlockManagerError):
    """A ``KVBlockManager`` argument has a wrong type or is out of range (no coercion: ``10.7`` blocks or ``"no"``
    for a flag is a mistake to name, not to round or read as true)."""


class PoolMismatchError(BlockManagerError):
    """Sequences cannot move between pools of different block sizes (their block tables would mean other tokens)."""


class DuplicateSequenceError(BlockManagerError, ValueError):
    """Raised when creating or forking into a sequence id that already exists."""


@dataclass(slots=True)
class SequenceBlocks:
    """A sequence's view of the pool: its block table, its length and, when tokens are known, what prefix caching
    needs to hash the block being filled."""

    block_table: array = field(default_factory=lambda: array(BLOCK_ID))
    num_tokens: int = 0
    partial_token_ids: list[int] | None = None  # tokens of the trailing partial block; None when unknown
    known_tokens: list[int] | None = None  # all its tokens while partial_token_ids is tracked (for invariants)
    parent_content_id: int = ROOT_CONTENT_ID  # content id of the last full block
    exclusive: bool = False  # True while no block can have another holder (never forked, hit or cached)
    stream_key: object = None  # content known as (stream key, position) for its first stream_blocks full blocks
    stream_blocks: int = 0
    stream_registered: int = 0  # leading blocks already registered in the prefix cache
    stream_deferred: bool = False  # its stream's registration waits for register_blocks or an ending release
    untracked_from: int = -1  # the first block left unhashed when tokens were appended without ids (-1: none)


class FreeBlockQueue:
    """Unreferenced blocks in the order they will be reused, as vLLM 0.32's free block queue keeps them
    (``BlockPool.free_blocks``, vllm/v1/core/block_pool.py): a block without a cache key goes to the head (reused
    first, last freed first), a cached one to the tail (cached blocks are evicted least recently released first).
    Allocation takes the head. A list with a moving head, so bulk allocation and release are list slices; a cached
    free block taken back by a prefix hit leaves its entry as a tombstone (-1) that allocation skips (only cached
    blocks that a lookup can find are taken from the middle, so only their entry positions are tracked: an ended
    stream's blocks are queued without one)."""

    def __init__(self, num_blocks: int, block_keys: list):
        self.entries = array(BLOCK_ID, np.arange(num_blocks, dtype=np.intc).tobytes())  # from one buffer, not element by element
        self.head = 0  # entries[head:] are queued
        self.base = 0  # entries dropped by compaction (positions are absolute)
        self.num_free, self.num_stale, self.num_keyed = num_blocks, 0, 0
        self.position = [-1] * num_blocks  # absolute entry index of each queued block that has a cache key
        # Absolute entry ranges of ended streams' blocks, oldest first. The head only moves forward by allocation and
        # back by a prepend, which writes blocks without keys, and the tail only grows: an entry below the highest
        # position the head has reached (``high_water``) has been consumed, so a range's queued part starts there
        # (no range is trimmed as allocation passes through it; ranges wholly below it are dropped in bulk).
        self.ended: deque[tuple[int, int]] = deque()
        self.prepend_water = 0  # the highest position the head reached before its last move back (a prepend)
        self.compact_at = COMPACT_MIN  # compact once the head passes this (half the entries at the last compaction)
        self.prune_at = ENDED_PRUNE_MIN  # drop consumed ended ranges once this many are kept
        self.block_keys = block_keys

    def __len__(self) -> int:
        return self.num_free

    @property
    def high_water(self) -> int:
        """The highest absolute entry position the head has reached (entries below it have been consumed)."""
        return max(self.prepend_water, self.base + self.head)

    def prepend_unkeyed(self, blocks: array) -> None:
        """Queue blocks that have no cache key at the head, ``blocks[0]`` to be reused first."""
        count, head = len(blocks), self.head
        if self.base + head > self.prepend_water:  # the head moves back: remember how far it had come
            self.prepend_water = self.base + head
        if count > head:  # room before the head: pad the front (entry positions stay absolute through ``base``)
            pad = count - head + len(self.entries) // 2 + 64
            self.entries[0:0] = array(BLOCK_ID, bytes(pad * self.entries.itemsize))
            self.base -= pad
            head += pad
            self.compact_at = max(COMPACT_MIN, len(self.entries) // 2)  # the padding is not consumed entries
        head -= count
        self.entries[head:head + count] = blocks
        self.head = head
        self.num_free += count

    def push_ended(self, blocks: array) -> None:
        """Queue an ended stream's blocks at the tail, in order, as cached blocks are queued (``push``): they are
        cached in effect, but no lookup can find them, so they need neither a cache entry nor an entry position, and
        reusing one evicts nothing. Only their entry ranges are kept, for views (``ended_blocks``)."""
        start, ended = self.base + len(self.entries), self.ended
        self.entries.extend(blocks)
        if len(ended) >= self.prune_at:
            self._drop_consumed_ranges()
        ended.append((start, start + len(blocks)))
        self.num_free += len(blocks)

    def push_ended_one(self, block: int) -> None:
        """``push_ended`` of one block (joining the last range when it ends here)."""
        end, ended = self.base + len(self.entries), self.ended
        self.entries.append(block)
        if len(ended) >= self.prune_at:
            self._drop_consumed_ranges()
        if ended and ended[-1][1] == end:
            ended[-1] = (ended[-1][0], end + 1)
        else:
            ended.append((end, end + 1))
        self.num_free += 1

    def _drop_consumed_ranges(self) -> None:
        """Drop the ended ranges wholly below the high water (consumed), oldest first; the next drop waits until as
        many ranges again are kept (amortized O(1) per push)."""
        ended, consumed = self.ended, self.high_water
        while ended and ended[0][1] <= consumed:
            ended.popleft()
        self.prune_at = max(ENDED_PRUNE_MIN, 2 * len(ended))

    def ended_blocks(self) -> set[int]:
        """The queued blocks of ended streams (O(their entries); for views and checks)."""
        base, first = self.base, self.high_water
        return {block for start, end in self.ended
                for block in self.entries[max(start, first) - base:max(end, first) - base] if block >= 0}

    def push(self, block: int) -> None:
        if self.block_keys[block] is not None:
            self.position[block] = self.base + len(self.entries)
            self.num_keyed += 1
        self.entries.append(block)
        self.num_free += 1

    def take(self, block: int) -> None:
        """A prefix hit takes a queued cached block: its entry becomes a tombstone."""
        self.entries[self.position[block] - self.base] = -1
        self.num_free -= 1
        self.num_stale += 1
        self.num_keyed -= 1

    def pop(self, count: int) -> array:
        """The ``count`` least recently released blocks (the caller checks there are enough)."""
        entries, head = self.entries, self.head
        taken = entries[head:head + count]
        head += count
        if self.num_stale:  # tombstones among them: drop each and take as many entries more (slices, not a loop)
            stale = taken.count(-1)
            while stale:
                self.num_stale -= stale
                for _ in range(stale):
                    taken.remove(-1)
                more = entries[head:head + stale]
                head += stale
                stale = more.count(-1)
                taken.extend(more)
        self.num_free -= count
        if head > self.compact_at:  # compact: drop the consumed prefix
            self._compact(head)
            head = 0
        self.head = head
        return taken

    def _compact(self, head: int) -> None:
        """Drop the consumed entries before ``head`` (entry positions stay absolute through ``base``)."""
        if self.base + head > self.prepend_water:
            self.prepend_water = self.base + head
        del self.entries[:head]
        self.base += head
        self.compact_at = max(COMPACT_MIN, len(self.entries) // 2)

    def pop_one(self) -> int:
        """The least recently released block (the caller checks there is one)."""
        if self.num_stale:
            return self.pop(1)[0]
        block = self.entries[self.head]
        self.head += 1
        self.num_free -= 1
        return block

    def queued(self) -> list[int]:
        """The queued blocks in order, stale entries left out (O(queue); for checks and views)."""
        return [block for block in self.entries[self.head:] if block >= 0]


class KVBlockManager:
    """Allocates KV-cache blocks to sequences.

    Args:
        num_physical_blocks: size of the pool.
        block_size: token slots per block.
        enable_prefix_caching: reuse full blocks whose prefix (all tokens up to and including the block) matches.
        offload_blocks: host slots of an offload tier below the prefix cache (``lab.kv_cache.offload``; 0: none, None:
            unbounded): a cached block the pool reuses is stored there, and a prompt that misses on the GPU but hits
            there gets fresh blocks loaded from it (``take_offload_copies`` hands the copies to the executor).
        offload_host: the host pool (another manager) whose blocks the tier borrows as its slots, so that swapped
            sequences and the tier share one host budget (``offload_blocks`` is then only on/off).
    """

    def __init__(self, num_physical_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 offload_blocks: int | None = 0, offload_host: "KVBlockManager | None" = None):
        check_int("KVBlockManager", "num_physical_blocks", num_physical_blocks, 1, MAX_POOL_BLOCKS,
                  error=BlockManagerConfigError)
        check_int("KVBlockManager", "block_size", block_size, 1, 1 << 20, error=BlockManagerConfigError)
        check_bool("KVBlockManager", "enable_prefix_caching", enable_prefix_caching, error=BlockManagerConfigError)
        self.num_physical_blocks = int(num_physical_blocks)
        self.block_size = int(block_size)
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * self.num_physical_blocks  # stored counts (see the module docstring)
        if offload_blocks is not None:
            check_int("KVBlockManager", "offload_blocks", offload_blocks, 0, MAX_POOL_BLOCKS,
                      error=BlockManagerConfigError)
        self.offload = OffloadTier(offload_blocks, offload_host) \
            if enable_prefix_caching and offload_blocks != 0 else None
        self.prefix_cache = PrefixCache(self.num_physical_blocks, self.block_size, enable_prefix_caching, self.offload)
        self._prompt_registration = False
        self.free_block_queue = FreeBlockQueue(self.num_physical_blocks, self.prefix_cache.block_keys)
        self.sequences: dict[object, SequenceBlocks] = {}
        self.pending_copies: list[tuple[int, int]] = []
        self._reserved = array(BLOCK_ID)  # taken from the pool for appends announced in bulk (reserve_blocks)
        self.lent: set[int] = set()  # blocks lent to another owner (an offload tier's slots: lend_block)
        self._reserve_backlog = 0  # reserved blocks not yet taken off the free queue (see reserve_blocks)
        self.num_block_references = 0  # block-table entries of every sequence plus reserved blocks (sum of counts)
        self.prefix_cache_stats: PrefixCacheStats = self.prefix_cache.stats
        self.num_cow_copies = 0

    # ---- pool queries -------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: every block nobody references (cached ones included)."""
        return self.free_block_queue.num_free

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one sequence (or reserved)."""
        return self.num_physical_blocks - self.free_block_queue.num_free

    @property
    def num_cached_blocks(self) -> int:
        """Full blocks currently registered in the prefix cache (referenced or evictable), ended streams' free blocks
        included."""
        self._flush_reserve()
        return len(self.prefix_cache) + len(self.free_block_queue.ended_blocks())

    @property
    def reserved_blocks(self) -> list[int]:
        """Blocks reserved and not yet handed to a sequence."""
        self._flush_reserve()
        return list(self._reserved)

    @property
    def ref_counts(self) -> list[int]:
        """Holders of each physical block (a reserved block counts one); a fresh list, O(pool): for views and
        checks. The hot path asks ``is_shared``."""
        self._flush_reserve()
        counts = list(self._ref_counts)
        for seq in self.sequences.values():
            if seq.exclusive:
                for block in seq.block_table:
                    counts[block] += 1
        for block in chain(self._reserved, self.lent):
            counts[block] += 1
        return counts

    def is_shared(self, block: int) -> bool:
        """Whether a held block has more than one holder (appending into it then copies it first)."""
        return self._ref_counts[block] > 1

    def _blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    # ---- sequence lifecycle -------------------------------------------------------------------------------
    def can_allocate(self, prompt_token_ids: Sequence[int] | None = None, num_prompt_tokens: int | None = None,
                     extra_blocks: int = 0, stream_key=None) -> bool:
        """Whether ``create_sequence`` with these arguments would succeed now, leaving ``extra_blocks`` free too."""
        num_tokens, token_ids = self._prompt_args(prompt_token_ids, num_prompt_tokens)
        hits, _ = self._lookup(token_ids, num_tokens, stream_key)
        return self._shortfall(num_tokens, hits) + extra_blocks <= 0

    def create_sequence(self, seq_id, prompt_token_ids: Sequence[int] | None = None,
                        num_prompt_tokens: int | None = None, stream_key=None, register_stream: bool = True,
                        max_new_tokens: int | None = None) -> int:
        """Allocate blocks for a new sequence's prompt and return how many leading tokens came from the prefix cache.
        With ``max_new_tokens``, only the cache hits and at most that many more tokens (a first prompt chunk, as vLLM
        V1's ``allocate_slots`` allocates for the tokens it schedules); ``append_tokens`` adds the rest.

        Give ``prompt_token_ids`` (enables prefix caching for this sequence) or just ``num_prompt_tokens`` (with a
        ``stream_key``, prefix caching by stream position: its full blocks are registered now, or with
        ``register_stream=False`` only when ``register_blocks`` is called); with neither the sequence starts
        empty. The last prompt token is never served from the cache, so a caller always
        has at least one token to compute. Raises ``OutOfBlocksError`` (nothing changed) when the pool is too small.
        """
        self._check_new_id(seq_id)
        num_tokens, token_ids = self._prompt_args(prompt_token_ids, num_prompt_tokens)
        hits, tier = self._lookup(token_ids, num_tokens, stream_key)
        size = self.block_size
        if max_new_tokens is not None:
            num_tokens = min(num_tokens, (len(hits) + len(tier)) * size + _count(max_new_tokens, "max_new_tokens"))
            token_ids = token_ids[:num_tokens] if token_ids is not None else None
        blocks = -(-num_tokens // size)
        # enough free blocks for the whole prompt suffice (hits only lower the need): skip counting them
        if blocks > self.free_block_queue.num_free and self._shortfall(num_tokens, hits) > 0:
            raise OutOfBlocksError(f"sequence {seq_id!r} needs {blocks - len(hits)} blocks, "
                                   f"{self.num_free_blocks} free")
        tracked = token_ids is not None and self.enable_prefix_caching  # its tokens are hashed into cache keys
        if token_ids is not None or not self.enable_prefix_caching:
            stream_key = None
        if hits or tracked or tier:
            seq = self._create_from_cache(hits, num_tokens, token_ids, tier)
            if stream_key is not None:
                seq.stream_key, seq.stream_blocks = stream_key, num_tokens // size
                seq.stream_registered = len(hits) + len(tier)
        else:  # fresh blocks only, each with one holder (the simulator's hot path)
            seq = SequenceBlocks(self._allocate_blocks(blocks), num_tokens, None, None, ROOT_CONTENT_ID, True,
                                 stream_key, num_tokens // size if stream_key is not None else 0)
        self.sequences[seq_id] = seq
        self.num_block_references += len(seq.block_table)
        if tracked or stream_key is not None:  # the lookup counts in the prefix-cache statistics
            stats = self.prefix_cache_stats
            stats.queried_blocks += (num_tokens - 1) // size if num_tokens else 0
            if hits or tier:  # GPU and tier hits alike: the prefill skips both
                stats.hit_blocks += len(hits) + len(tier)
                stats.hit_tokens += (len(hits) + len(tier)) * size
        if stream_key is not None:
            if register_stream:
                self.register_blocks(seq_id)
            else:
                seq.stream_deferred = True
        return (len(hits) + len(tier)) * size

    def create_unseen_stream(self, seq_id, num_tokens: int, stream_key) -> None:
        """``create_sequence(seq_id, num_prompt_tokens=num_tokens, stream_key=stream_key, register_stream=False)`` for
        a stream the prefix cache has no block of (``PrefixCache.has_stream`` false, the caller's check) in a pool
        with prefix caching and no offload tier: no lookup can hit, so its blocks are fresh and the lookup is skipped
        (the simulator's admission of a new request of one sample). Raises as ``create_sequence`` does."""
        if not self.enable_prefix_caching or self.offload is not None or type(num_tokens) is not int \
                or num_tokens < 0:
            raise BlockManagerError("create_unseen_stream: a pool with prefix caching and no offload tier, and a "
                                    f"token count >= 0 (got {num_tokens!r})")
        self._check_new_id(seq_id)
        size = self.block_size
        blocks = -(-num_tokens // size)
        if blocks > self.free_block_queue.num_free:
            raise OutOfBlocksError(f"sequence {seq_id!r} needs {blocks} blocks, {self.num_free_blocks} free")
        seq = SequenceBlocks(self._allocate_blocks(blocks), num_tokens, None, None, ROOT_CONTENT_ID, True,
                             stream_key, num_tokens // size)
        seq.stream_deferred = True
        self.sequences[seq_id] = seq
        self.num_block_references += blocks
        if num_tokens:  # the lookup that was skipped counts in the prefix-cache statistics
            self.prefix_cache_stats.queried_blocks += (num_tokens - 1) // size

    def _create_from_cache(self, hits: list[int], num_tokens: int, token_ids: list[int] | None,
                           tier: list[tuple] = ()) -> SequenceBlocks:
        """A new sequence's blocks: the cache hits, the blocks loaded from the offload tier (the keys ``tier``), then
        fresh blocks (hashing its tokens when they are known)."""
        tracked = token_ids is not None and self.enable_prefix_caching
        cached = (len(hits) + len(tier)) * self.block_size
        for block in hits:
            self._take_cached_block(block)
        table = array(BLOCK_ID, hits)
        if tier:
            table.extend(self._load_from_tier(tier))
        seq = SequenceBlocks(table, cached, [] if tracked else None, list(token_ids[:cached]) if tracked else None,
                             self.prefix_cache.content_ids[table[-1]] if table else ROOT_CONTENT_ID)
        self._prompt_registration = True  # the blocks this prompt fills are prompt blocks (PrefixCache.prompt_blocks)
        try:
            self._grow(seq, num_tokens - cached, token_ids[cached:] if token_ids is not None else None)
        finally:
            self._prompt_registration = False
        return seq

    def _load_from_tier(self, keys: list[tuple]) -> array:
        """Fresh blocks for the tier's hits, cached under the same keys, a load queued for each. Their slots are
        taken (pinned) before the blocks: allocating may evict cached blocks into the tier, which must not reuse
        them."""
        slots = [self.offload.take(key) for key in keys]
        blocks = self._allocate_blocks(len(keys))
        for block in blocks:
            self._ref_counts[block] = 1
        self.prefix_cache.register_loaded(keys, slots, blocks)
        return blocks

    def take_offload_copies(self) -> OffloadCopies:
        """The tier's copies queued since the last call."""
        return self.prefix_cache.take_tier_copies()

    def register_blocks(self, seq_id, token_ids=None, sampled: bool = False, ending: bool = False) -> None:
        """Register a sequence's full blocks in the prefix cache (if not done yet): a stream sequence's prompt
        blocks, with ``sampled`` its later ones too (the stream of a request of one sample is that sample's own);
        given ``token_ids`` (its tokens, at least as many as it holds), every full block of a sequence whose
        later tokens were appended without ids, sampled tokens' included, as vLLM V1 caches a request's blocks while
        they fill (``KVCacheManager.allocate_slots`` → ``cache_blocks``, vllm/v1/core/kv_cache_manager.py), so that
        a preempted request hits its own blocks when it is prefilled again. Any time before a block's release gives
        the same later hits as when it filled: what the free queue goes by is whether it is cached when it is freed.
        ``ending`` (the sequence is released next, its stream ending with it): a stream whose registration was
        deferred takes its sampled blocks into the stream's count only, to be freed as cached ones
        (``release_sequence(end_stream=True)``)."""
        seq = self._seq(seq_id)
        if ending and seq.stream_deferred:
            seq.stream_blocks = max(seq.stream_blocks, seq.num_tokens // self.block_size)
            return
        self._flush_reserve()
        if seq.stream_key is not None:
            seq.stream_deferred = False
            prompt_blocks = seq.stream_blocks  # its prompt's (the tier keeps prompt blocks only, as the engine's)
            if sampled:
                seq.stream_blocks = max(seq.stream_blocks, seq.num_tokens // self.block_size)
            if seq.stream_registered < seq.stream_blocks:
                self._share(seq)  # its blocks get cache keys
                register, parent = self.prefix_cache.register_stream, seq.parent_content_id
                split = max(seq.stream_registered, prompt_blocks)
                parent = register(parent, seq.stream_key, seq.block_table, seq.stream_registered, split)
                seq.parent_content_id = register(parent, seq.stream_key, seq.block_table, split, seq.stream_blocks,
                                                 prompt=False)
                seq.stream_registered = seq.stream_blocks
            return
        full = seq.num_tokens // self.block_size
        if token_ids is not None and 0 <= seq.untracked_from < full and len(token_ids) >= full * self.block_size:
            self._share(seq)
            size, register = self.block_size, self.prefix_cache.register
            for index in range(seq.untracked_from, full):
                seq.parent_content_id = register(seq.parent_content_id, seq.block_table[index],
                                                 token_ids[index * size:(index + 1) * size])
            seq.untracked_from = full

    def extend_stream(self, seq_id) -> None:
        """A stream sequence's prompt grew by a chunk: its full blocks join its stream, registered now unless its
        registration was left for later (``create_sequence(register_stream=False)``: ``register_blocks`` or
        ``release_sequence(end_stream=True)`` then takes them)."""
        seq = self._seq(seq_id)
        if seq.stream_deferred:
            seq.stream_blocks = max(seq.stream_blocks, seq.num_tokens // self.block_size)
        elif seq.stream_key is not None:
            self.register_blocks(seq_id, sampled=True)

    def fork_sequence(self, parent_id, child_id) -> None:
        """Make ``child_id`` share every block of ``parent_id`` (reference counts go up; nothing is copied)."""
        parent = self._seq(parent_id)
        self._check_new_id(child_id)
        self._share(parent)
        ref_counts = self._ref_counts
        for block in parent.block_table:
            ref_counts[block] += 1
        self.num_block_references += len(parent.block_table)
        partial = list(parent.partial_token_ids) if parent.partial_token_ids is not None else None
        known = list(parent.known_tokens) if parent.known_tokens is not None else None
        self.sequences[child_id] = SequenceBlocks(parent.block_table[:], parent.num_tokens, partial, known,
                                                  parent.parent_content_id)

    def release_sequence(self, seq_id, num_reserved: int = 0, end_stream: bool = False) -> None:
        """Drop a sequence; blocks whose count reaches zero become free (cached ones stay reusable, LRU). With
        ``num_reserved``, the last that many reserved blocks (ones it would have taken with ``from_reserved``
        appends) are freed with it, as if appended first. Uncached blocks are reused first, cached ones last
        (``FreeBlockQueue``). With ``end_stream``, the stream ends with the sequence (a finished request of one
        sample): its stream blocks not registered yet are freed as cached blocks (``FreeBlockQueue.push_ended``), as
        registering them at admission would have freed them, without the entries no lookup could find."""
        seq = self._seq(seq_id)
        if num_reserved:
            if type(num_reserved) is not int or num_reserved < 0:
                num_reserved = _count(num_reserved, "num_reserved")
            if num_reserved > len(self._reserved) + self._reserve_backlog:
                raise OutOfBlocksError(f"releasing {num_reserved!r} reserved blocks, "
                                       f"{len(self._reserved) + self._reserve_backlog} reserved")
        else:
            num_reserved = 0
        del self.sequences[seq_id]
        table = seq.block_table
        self.num_block_references -= len(table) + num_reserved
        ref_counts, free = self._ref_counts, self.free_block_queue
        if self._reserve_backlog:  # reserved blocks leave the head before freed ones are put there
            self._flush_reserve()
        # vLLM frees a request's blocks tail first: the newest reserved blocks (as if appended), then the table's
        unkeyed = self._take_reserved(num_reserved) if num_reserved else array(BLOCK_ID)
        ended = seq.stream_blocks - seq.stream_registered if end_stream and seq.stream_deferred else 0
        if seq.exclusive:
            self._free_exclusive(table, unkeyed, ended)
            return
        keys = self.prefix_cache.block_keys
        first_ended, end_ended = (seq.stream_registered, seq.stream_blocks) if ended > 0 else (0, 0)
        for index in range(len(table) - 1, -1, -1):
            block = table[index]
            count = ref_counts[block] - 1
            ref_counts[block] = count
            if count == 0:
                if keys[block] is not None:
                    free.push(block)
                elif first_ended <= index < end_ended:
                    free.push_ended_one(block)
                else:
                    unkeyed.append(block)
        if unkeyed:
            free.prepend_unkeyed(unkeyed)

    def release_ending_stream(self, seq_id, num_tokens: int) -> bool:
        """``append_tokens(seq_id, num_tokens - its length, from_reserved=True)``, ``register_blocks(seq_id,
        sampled=True, ending=True)`` and ``release_sequence(seq_id, end_stream=True)`` in one call, for an exclusive
        sequence whose stream registration was deferred and whose tokens are not tracked (the simulator's finish of a
        request of one sample, once per request); False, with nothing changed, for any other sequence or when the
        reserved blocks fall short (the three calls then say what is wrong)."""
        seq = self.sequences.get(seq_id)
        if seq is None or not seq.exclusive or not seq.stream_deferred or seq.partial_token_ids is not None \
                or type(num_tokens) is not int or num_tokens < seq.num_tokens:
            return False
        table = seq.block_table
        new_blocks = -(-num_tokens // self.block_size) - len(table)
        if new_blocks > len(self._reserved) + self._reserve_backlog:
            return False
        if new_blocks:
            table.extend(self._take_reserved(new_blocks))  # newest first, as append_tokens hands them over
        elif self._reserve_backlog:
            self._flush_reserve()
        del self.sequences[seq_id]
        self.num_block_references -= len(table)
        ended = max(seq.stream_blocks, num_tokens // self.block_size) - seq.stream_registered
        self._free_exclusive(table, None, ended)
        return True

    def _free_exclusive(self, table: array, unkeyed: array | None, ended: int) -> None:
        """Free a dead exclusive sequence's ``table`` after ``unkeyed`` (if any; every block has one holder, stored
        as 0, and only its first ``ended`` blocks, an ended stream's, count as cached): in bulk, tail first."""
        free = self.free_block_queue
        keyed = None
        if ended > 0:  # an exclusive sequence registered nothing: its ended blocks lead
            keyed = table[:ended]
            del table[:ended]
        table.reverse()  # the table dies with the sequence: reverse it in place
        if unkeyed:
            unkeyed.extend(table)
            table = unkeyed
        free.prepend_unkeyed(table)
        if keyed:
            keyed.reverse()  # the tail's first to go is the stream's last block, as freeing tail first gives
            free.push_ended(keyed)

    # ---- appending ----------------------------------------------------------------------------------------
    def num_blocks_to_append(self, seq_id, num_tokens: int = 1) -> int:
        """New blocks that appending ``num_tokens`` tokens to ``seq_id`` would take (copy-on-write included)."""
        seq = self._seq(seq_id)
        num_tokens = _count(num_tokens, "num_tokens")
        return self._cow_needed(seq) + self._blocks_for_tokens(seq.num_tokens + num_tokens) - len(seq.block_table)

    def reserve_blocks(self, count: int) -> None:
        """Take ``count`` blocks from the pool now for appends that ask for ``from_reserved`` later (a scheduler that
        knows how many sequences cross a block boundary this step reserves for all of them at once and hands the
        blocks out when it next touches each sequence). Raises ``OutOfBlocksError`` (nothing changed).

        O(1): the blocks leave the free count now and the free queue at the next operation that could tell the
        difference, which then takes them all at once, in the order single reservations would have."""
        if type(count) is not int or count < 0:
            count = _count(count, "count")
        if not self.try_reserve_counted_blocks(count):
            raise OutOfBlocksError(f"reserving {count} blocks, {self.num_free_blocks} free")

    def try_reserve_counted_blocks(self, count: int) -> bool:
        """``reserve_blocks`` that returns False (nothing changed) when fewer than ``count`` blocks are free, for a
        ``count`` the caller guarantees is an int >= 0 (a scheduler's per-step call with a count of sequences: the
        check would cost a tenth of the call)."""
        free = self.free_block_queue
        if count > free.num_free:
            return False
        free.num_free -= count
        self._reserve_backlog += count
        self.num_block_references += count
        if self.offload is not None:  # the blocks leave the queue now: a cached one is stored in this step
            self._flush_reserve()
        return True

    def append_token(self, seq_id, token_id: int | None = None) -> int:
        """Append one token and return its linear slot ``physical_block * block_size + offset``.

        Takes a new block only when the token starts one, or when the last block is shared and partly filled
        (copy-on-write: the copy ``(src, dst)`` is queued in ``pending_copies`` for the cache to execute).
        """
        seq = self._seq(seq_id)
        if token_id is not None:
            token_id = _token(token_id, "token_id")  # checked before anything changes
        self._flush_reserve()
        offset = seq.num_tokens % self.block_size
        if offset == 0:
            self._check_free(1, seq_id)
            seq.block_table.append(self._held_by(seq, self._allocate_blocks(1))[0])
            self.num_block_references += 1
        elif self._ref_counts[seq.block_table[-1]] > 1:
            self._check_free(1, seq_id)
            self._copy_on_write(seq)
        block = seq.block_table[-1]
        seq.num_tokens += 1
        if seq.partial_token_ids is not None:
            self._track_token(seq, token_id)
        return block * self.block_size + offset

    def append_tokens(self, seq_id, num_tokens: int, token_ids: Sequence[int] | None = None,
                      from_reserved: bool = False) -> None:
        """Append ``num_tokens`` tokens at once, O(blocks); same effect as that many ``append_token`` calls. With
        ``from_reserved`` the new blocks come from ``reserve_blocks`` (a copy-on-write still takes a free block)."""
        num_tokens = _count(num_tokens, "num_tokens")
        if token_ids is not None:
            token_ids = _token_list(token_ids, "token_ids")
            if len(token_ids) != num_tokens:
                raise InvalidTokenError(f"token_ids has {len(token_ids)} ids, num_tokens is {num_tokens}")
        seq = self._seq(seq_id)
        self._flush_reserve()
        size, table = self.block_size, seq.block_table
        cow = num_tokens and seq.num_tokens % size and self._ref_counts[table[-1]] > 1
        new_blocks = -(-(seq.num_tokens + num_tokens) // size) - len(table)
        if from_reserved:
            if new_blocks > len(self._reserved):
                raise OutOfBlocksError(f"sequence {seq_id!r} needs {new_blocks} reserved blocks, "
                                       f"{len(self._reserved)} reserved")
            if cow:
                self._check_free(1, seq_id)
        elif (cow or new_blocks) and new_blocks + bool(cow) > len(self.free_block_queue):
            self._check_free(new_blocks + bool(cow), seq_id)  # raises OutOfBlocksError
        if cow:
            self._copy_on_write(seq)
        if not from_reserved:
            self.num_block_references += new_blocks
        take = self._take_reserved if from_reserved else self._allocate_blocks
        if seq.partial_token_ids is None:  # the simulator's hot path: no tokens to hash
            if new_blocks:
                table.extend(self._held_by(seq, take(new_blocks)))
            seq.num_tokens += num_tokens
            return
        self._grow(seq, num_tokens, token_ids, take)

    # ---- swapping -----------------------------------------------------------------------------------------
    def num_distinct_blocks(self, seq_ids: Iterable) -> int:
        """Physical blocks the sequences hold, a shared block counted once."""
        return len({block for s in seq_ids for block in self._seq(s).block_table})

    def can_move_sequences(self, seq_ids: Sequence, target: "KVBlockManager", extra_blocks: int = 0) -> bool:
        """Whether ``move_sequences(seq_ids, target)`` would succeed and leave ``extra_blocks`` free there."""
        return self.num_distinct_blocks(seq_ids) + extra_blocks <= target.num_free_blocks

    def move_sequences(self, seq_ids: Sequence, target: "KVBlockManager") -> list[tuple[int, int]]:
        """Swap: move sequences, with their blocks, into ``target``'s pool (e.g. device to host and back). Blocks
        they share stay shared there. Returns the ``(block here, block there)`` copies the caches must run. The
        moved sequences' tokens are no longer tracked for prefix caching. Raises ``OutOfBlocksError`` or a
        sequence-id error with both managers unchanged."""
        if not isinstance(target, KVBlockManager) or target.block_size != self.block_size:
            raise PoolMismatchError(f"cannot move sequences from a pool of block size {self.block_size} into "
                                    f"{getattr(target, 'block_size', target)!r:.40}")
        seq_ids = list(seq_ids)
        tables = [self._seq(s).block_table for s in seq_ids]
        if len(set(seq_ids)) != len(seq_ids):
            raise DuplicateSequenceError(f"move_sequences got a sequence twice: {seq_ids!r}")
        for s in seq_ids:
            if s in target.sequences:
                raise DuplicateSequenceError(f"sequence {s!r} already exists in the target pool")
        distinct = list(dict.fromkeys(block for table in tables for block in table))
        if len(distinct) > target.num_free_blocks:
            raise OutOfBlocksError(f"moving {len(seq_ids)} sequences needs {len(distinct)} blocks, "
                                   f"{target.num_free_blocks} free in the target")
        placed = dict(zip(distinct, target._allocate_blocks(len(distinct))))
        for seq_id, table in zip(seq_ids, tables):
            moved = SequenceBlocks(array(BLOCK_ID, [placed[b] for b in table]), self.sequences[seq_id].num_tokens)
            for block in moved.block_table:
                target._ref_counts[block] += 1
            target.sequences[seq_id] = moved
            target.num_block_references += len(moved.block_table)
        for seq_id in seq_ids:
            self.release_sequence(seq_id)
        return list(placed.items())

    def lend_block(self) -> int | None:
        """A free block for another owner to use as storage (an offload tier's host slot), None when none is free.
        It counts as used until ``return_block``; cached blocks are not handed out (a lending pool caches nothing)."""
        if self.enable_prefix_caching:
            raise BlockManagerError("a pool with prefix caching lends no blocks (their cached contents would go)")
        if not self.num_free_blocks:
            return None
        block = self._allocate_blocks(1)[0]
        self.lent.add(block)
        self.num_block_references += 1
        return block

    def return_block(self, block: int) -> None:
        """A block ``lend_block`` handed out is free again."""
        self.lent.remove(block)
        self.num_block_references -= 1
        self.free_block_queue.push(block)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """Return and clear the copy-on-write copies ``(src_block, dst_block)`` the cache must execute."""
        copies = self.pending_copies[:]
        self.pending_copies.clear()  # the same list: a policy holds it to see pending copies without a call
        return copies

    # ---- exports ------------------------------------------------------------------------------------------
    def get_block_table(self, seq_id) -> list[int]:
        """The sequence's physical block ids, logical order."""
        return list(self._seq(seq_id).block_table)

    def block_table_view(self, seq_id) -> array:
        """The sequence's block table itself, not a copy (read-only for the caller). The pool replaces the object
        when the sequence is created, forked or moved, and changes it otherwise only by appending blocks or by
        replacing the last one (copy-on-write): what ``lab.worker.block_tables`` relies on."""
        return self._seq(seq_id).block_table

    def get_sequence_length(self, seq_id) -> int:
        """Tokens the sequence holds."""
        return self._seq(seq_id).num_tokens

    def get_slot_mapping(self, seq_id, start: int, end: int) -> list[int]:
        """Linear slots of the sequence's token positions ``start <= pos < end``."""
        seq = self._seq(seq_id)
        start, end = _count(start, "start"), _count(end, "end")
        if not start <= end <= seq.num_tokens:
            raise InputError(f"positions [{start}, {end}) outside sequence {seq_id!r} of {seq.num_tokens} tokens")
        size, table = self.block_size, seq.block_table
        return [table[pos // size] * size + pos % size for pos in range(start, end)]

    def get_decode_slots(self, seq_ids: list, positions: list[int]) -> list[int]:
        """The slot of position ``positions[i]`` of sequence ``seq_ids[i]``, for each ``i`` (a decode step's one token
        per sequence; the positions are the runner's own, inside each sequence)."""
        size, sequences = self.block_size, self.sequences
        return [sequences[seq_id].block_table[position // size] * size + position % size
                for seq_id, position in zip(seq_ids, positions)]

    def is_cached(self, block: int) -> bool:
        """Whether a physical block is registered in the prefix cache, or a free block of an ended stream (cached in
        effect: ``release_sequence(end_stream=True)``). O(queue): views ask ``cached_blocks``."""
        self._flush_reserve()
        return self.prefix_cache.is_cached(block) or block in self.free_block_queue.ended_blocks()

    def cached_blocks(self) -> list[bool]:
        """``is_cached`` of every physical block, in one pass."""
        self._flush_reserve()
        ended, keys = self.free_block_queue.ended_blocks(), self.prefix_cache.block_keys
        return [keys[block] is not None or block in ended for block in range(self.num_physical_blocks)]

    # ---- invariants ---------------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise ``AssertionError`` describing the first broken invariant of the pool."""
        self._flush_reserve()
        uses, shared_uses = [0] * self.num_physical_blocks, [0] * self.num_physical_blocks
        for seq_id, seq in self.sequences.items():
            assert len(seq.block_table) == self._blocks_for_tokens(seq.num_tokens), f"{seq_id!r}: table size"
            for block in seq.block_table:
                uses[block] += 1
                shared_uses[block] += not seq.exclusive
        for block in chain(self._reserved, self.lent):
            uses[block] += 1
        assert shared_uses == self._ref_counts, "ref counts differ from block-table uses"
        assert sum(uses) == self.num_block_references, "num_block_references differs from block-table uses"
        counts = self.ref_counts
        assert uses == counts, "a block of an exclusive sequence or a reserved block has another holder"
        queued = self.free_block_queue.queued()
        assert len(queued) == len(set(queued)) == self.num_free_blocks, "free queue holds a block twice"
        assert set(queued) == {b for b, count in enumerate(counts) if count == 0}, "free queue vs counts"
        free = self.free_block_queue
        assert all(a[1] <= b[0] for a, b in zip(free.ended, list(free.ended)[1:])), "ended ranges overlap"
        assert all(end <= free.base + len(free.entries) for _, end in free.ended), "an ended range past the entries"
        assert free.base + free.head <= free.high_water <= free.base + len(free.entries), "high water off the queue"
        assert not any(self.prefix_cache.block_keys[b] is not None for b in free.ended_blocks()), "ended block keyed"
        self.prefix_cache.check()
        for seq_id, seq in self.sequences.items():
            if seq.known_tokens is not None:
                assert len(seq.known_tokens) == seq.num_tokens, f"{seq_id!r}: {len(seq.known_tokens)} known tokens"
                self.prefix_cache.check_tokens(seq_id, seq.block_table, seq.known_tokens)

    # ---- internals ----------------------------------------------------------------------------------------
    def _seq(self, seq_id) -> SequenceBlocks:
        try:
            return self.sequences[seq_id]
        except KeyError:
            raise UnknownSequenceError(seq_id) from None
        except TypeError:
            raise InvalidSequenceIdError(f"sequence ids must be hashable, got {seq_id!r}") from None

    def _check_new_id(self, seq_id) -> None:
        try:
            exists = seq_id in self.sequences
        except TypeError:
            raise InvalidSequenceIdError(f"sequence ids must be hashable, got {seq_id!r}") from None
        if exists:
            raise DuplicateSequenceError(f"sequence {seq_id!r} already exists")

    def _prompt_args(self, prompt_token_ids, num_prompt_tokens) -> tuple[int, list[int] | None]:
        if prompt_token_ids is None and type(num_prompt_tokens) is int and num_prompt_tokens >= 0:
            return num_prompt_tokens, None  # a plain count (the simulator's every admission)
        if prompt_token_ids is not None:
            token_ids = _token_list(prompt_token_ids, "prompt_token_ids")
            if num_prompt_tokens is not None and num_prompt_tokens != len(token_ids):
                raise InvalidTokenError(f"num_prompt_tokens={num_prompt_tokens!r} but {len(token_ids)} prompt_token_ids")
            return len(token_ids), token_ids
        num_tokens = 0 if num_prompt_tokens is None else _count(num_prompt_tokens, "num_prompt_tokens")
        return num_tokens, None

    def _lookup(self, token_ids: list[int] | None, num_tokens: int, stream_key) -> tuple[list[int], list[tuple]]:
        """The prompt's GPU prefix-cache hits, then the keys of the blocks after them that the offload tier holds."""
        cache, tier = self.prefix_cache, self.offload
        if token_ids is not None:
            self._flush_reserve()  # the reserved blocks leave the queue first: they may evict cached ones
            hits = cache.lookup(token_ids)
            return hits, cache.tier_hits(hits, num_tokens, token_ids, None) if tier is not None else []
        # a stream hits only from its first block on: without that block cached, skip the flush and the lookup
        if stream_key is not None and (cache.has_stream(stream_key) or tier is not None and
                                       tier.get(cache.stream_key(ROOT_CONTENT_ID, stream_key, 0)) is not None):
            self._flush_reserve()
            hits = cache.lookup_stream(stream_key, num_tokens)
            return hits, cache.tier_hits(hits, num_tokens, None, stream_key) if tier is not None else []
        return [], []

    def _shortfall(self, num_tokens: int, hits: list[int]) -> int:
        """Blocks missing to allocate a prompt of ``num_tokens`` tokens with these cache hits (<= 0: it fits). A hit
        on a free cached block takes it off the free queue too."""
        allocatable = self.free_block_queue.num_free
        if hits:
            allocatable -= sum(1 for block in hits if self._ref_counts[block] == 0)
        return -(-num_tokens // self.block_size) - len(hits) - allocatable

    def _check_free(self, needed: int, seq_id) -> None:
        if needed > self.num_free_blocks:
            raise OutOfBlocksError(f"sequence {seq_id!r} needs {needed} blocks, {self.num_free_blocks} free")

    def _grow(self, seq: SequenceBlocks, num_tokens: int, token_ids, source=None) -> None:
        """Append tokens, the new blocks taken at once from ``source(count)`` (default: the free queue; the caller has
        checked there are enough), then hash the blocks they complete when the sequence's tokens are tracked."""
        new_blocks = -(-(seq.num_tokens + num_tokens) // self.block_size) - len(seq.block_table)
        if new_blocks > 0:
            seq.block_table.extend(self._held_by(seq, (source or self._allocate_blocks)(new_blocks)))
        if seq.partial_token_ids is not None and num_tokens:
            if token_ids is None:  # tokens unknown from here on: cached only by register_blocks
                seq.partial_token_ids = seq.known_tokens = None
                seq.untracked_from = seq.num_tokens // self.block_size
            else:
                self._track_tokens(seq, token_ids)
        seq.num_tokens += num_tokens

    def _track_tokens(self, seq: SequenceBlocks, token_ids) -> None:
        """Register the full blocks that ``token_ids``, appended after ``seq.num_tokens``, complete. Their blocks
        were all taken before the first is registered: a block taken later in the same pop would otherwise still
        hold (and so dedupe, then evict) a key registered here."""
        size, table, partial = self.block_size, seq.block_table, seq.partial_token_ids
        seq.known_tokens.extend(token_ids)
        index, done = seq.num_tokens // size, 0
        if partial:  # first the block in progress
            done = min(size - len(partial), len(token_ids))
            partial.extend(token_ids[:done])
            if len(partial) < size:
                return
            seq.parent_content_id = self.prefix_cache.register(seq.parent_content_id, table[index], partial,
                                                               self._prompt_registration)
            index += 1
        whole = done + (len(token_ids) - done) // size * size
        for start in range(done, whole, size):  # then whole blocks, straight from the ids
            seq.parent_content_id = self.prefix_cache.register(seq.parent_content_id, table[index],
                                                               token_ids[start:start + size], self._prompt_registration)
            index += 1
        seq.partial_token_ids = list(token_ids[whole:])

    def _track_token(self, seq: SequenceBlocks, token_id) -> None:
        if token_id is None:  # tokens unknown from here on: cached only by register_blocks
            seq.partial_token_ids = seq.known_tokens = None
            seq.untracked_from = (seq.num_tokens - 1) // self.block_size  # num_tokens counts this token already
            return
        seq.partial_token_ids.append(int(token_id))
        seq.known_tokens.append(int(token_id))
        if len(seq.partial_token_ids) == self.block_size:
            seq.parent_content_id = self.prefix_cache.register(seq.parent_content_id, seq.block_table[-1],
                                                               seq.partial_token_ids)
            seq.partial_token_ids = []

    def _flush_reserve(self) -> None:
        """Take the blocks of ``reserve_blocks`` calls off the free queue (they left its count already)."""
        backlog = self._reserve_backlog
        if backlog:
            self._reserve_backlog = 0
            self.free_block_queue.num_free += backlog
            self._reserved.extend(self._allocate_blocks(backlog))

    def _allocate_blocks(self, count: int) -> array:
        """``count`` blocks from the head of the free queue (evicting cached ones), stored count still 0: the caller
        hands them to a holder (``_held_by``) or reserves them."""
        if self._reserve_backlog:
            self._flush_reserve()
        free = self.free_block_queue
        taken = free.pop(count)
        if free.num_keyed:
            cache = self.prefix_cache
            keys = cache.block_keys
            for block in taken:
                if keys[block] is not None:
                    free.num_keyed -= 1
                    cache.evict(block)  # reused: a prompt block's contents go to the offload tier
        return taken

    def _held_by(self, seq: SequenceBlocks, blocks: array) -> array:
        """Fresh or reserved ``blocks`` go to ``seq``: a non-exclusive holder's count is stored."""
        if not seq.exclusive:
            ref_counts = self._ref_counts
            for block in blocks:
                ref_counts[block] = 1
        return blocks

    def _share(self, seq: SequenceBlocks) -> None:
        """``seq`` stops being exclusive: store the counts of 1 its blocks had implicitly."""
        if seq.exclusive:
            seq.exclusive = False
            ref_counts = self._ref_counts
            for block in seq.block_table:
                ref_counts[block] = 1

    def _take_reserved(self, count: int, newest_first: bool = True) -> array:
        """The last ``count`` reserved blocks, newest first (as ``count`` single takes would hand them out), or in
        the order they were reserved."""
        if self._reserve_backlog:
            self._flush_reserve()
        reserved = self._reserved
        start = len(reserved) - count
        taken = reserved[start:]
        del reserved[start:]
        if newest_first:
            taken.reverse()
        return taken

    def _take_cached_block(self, block: int) -> None:
        if self._ref_counts[block] == 0:
            self.free_block_queue.take(block)
        self._ref_counts[block] += 1

    def _cow_needed(self, seq: SequenceBlocks) -> int:
        return int(seq.num_tokens % self.block_size != 0 and self._ref_counts[seq.block_table[-1]] > 1)

    def _copy_on_write(self, seq: SequenceBlocks) -> None:
        src = seq.block_table[-1]
        dst = self._held_by(seq, self._allocate_blocks(1))[0]
        self._ref_counts[src] -= 1
        seq.block_table[-1] = dst
        self.pending_copies.append((src, dst))
        self.num_cow_copies += 1


def _token(value, name: str) -> int:
    """A token id as a plain int, or ``InvalidTokenError`` naming the argument."""
    if type(value) is int:
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidTokenError(f"{name} must hold integer token ids, got {value!r}")
    return int(value)


def _count(value, name: str) -> int:
    """A non-negative count or position as a plain int, or ``InvalidTokenError`` naming the argument."""
    if type(value) is int and value >= 0:
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise InvalidTokenError(f"{name} must be a non-negative integer, got {value!r}")
    return int(value)


class TokenIds(tuple):
    """Token ids checked once: a tuple of plain ints that the manager's methods take without checking again. A
    request waiting for memory is offered to ``can_allocate`` every step; its prompt (maybe 100k tokens) is built
    and checked once. Raises ``InvalidTokenError`` as a list argument would."""

    __slots__ = ()

    def __new__(cls, values=()):
        return super().__new__(cls, _token_list(values, "token_ids"))

    @classmethod
    def unchecked(cls, values) -> "TokenIds":
        """Ids the caller built as plain ints (the simulator's synthetic prompts): taken without the check."""
        return tuple.__new__(cls, values)


def _token_list(values, name: str) -> list[int] | TokenIds:
    """A sequence of token ids as a list of plain ints (a ``TokenIds`` as it is), or ``InvalidTokenError`` naming
    the argument."""
    if type(values) is TokenIds:
        return values
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise InvalidTokenError(f"{name} must be a sequence of integer token ids, got {values!r}")
    values = list(values)
    if all(type(t) is int for t in values):
        return values
    return [_token(t, name) for t in values]
