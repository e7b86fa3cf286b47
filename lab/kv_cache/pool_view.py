"""Pictures of a block pool for people (the Block pool page, the live views, tests): copies, O(pool), never on the
hot path. They read ``KVBlockManager``'s public state only."""
from __future__ import annotations

from dataclasses import dataclass

from .block_manager import KVBlockManager
from .offload import OffloadStats, OffloadTier


@dataclass(slots=True)
class PoolSnapshot:
    """A copy of the pool's state for visualisation."""

    block_size: int
    ref_counts: list[int]
    owners: list[list]  # per physical block, the sequences holding it
    block_tables: dict  # sequence id -> physical block ids
    seq_lens: dict  # sequence id -> tokens
    cached: list[bool]  # per physical block, registered in the prefix cache
    num_free_blocks: int
    host_pool: "PoolSnapshot | None" = None  # with swap preemption: the host pool at the same moment
    offload: "TierSnapshot | None" = None  # with an offload tier: its host slots at the same moment
    cache_keys: list | None = None  # per physical block, its prefix-cache key (None: not cached), to tell evictions


@dataclass(slots=True)
class TierSnapshot:
    """The offload tier's host slots: per slot, its place in the LRU order (0: the next to be evicted), or -1
    when free; and the tier's counts so far."""

    lru_rank: list[int]
    stats: OffloadStats
    shares_host_pool: bool = False  # its slots are blocks of the host pool that swapped-out sequences use too

    @property
    def num_used_slots(self) -> int:
        return sum(rank >= 0 for rank in self.lru_rank)


def tier_snapshot(tier: OffloadTier) -> TierSnapshot:
    """A copy of ``tier``'s occupancy (an unbounded tier: the slots used so far)."""
    size = tier.capacity if tier.capacity is not None else tier.next_slot
    lru_rank = [-1] * size
    for rank, (slot, _) in enumerate(tier.entries.values()):
        lru_rank[slot] = rank
    stats = tier.stats
    return TierSnapshot(lru_rank, OffloadStats(stats.hit_blocks, stats.loaded_blocks, stats.stored_blocks,
                                               stats.peak_blocks))


def block_owners(manager: KVBlockManager) -> list[list]:
    """For each physical block, the ids of the sequences whose tables hold it."""
    owners: list[list] = [[] for _ in range(manager.num_physical_blocks)]
    for seq_id in manager.sequences:
        for block in manager.get_block_table(seq_id):
            owners[block].append(seq_id)
    return owners


def pool_snapshot(manager: KVBlockManager) -> PoolSnapshot:
    """Ref counts, owners, block tables, lengths and what is cached, copied now."""
    ref_counts = manager.ref_counts  # first: it brings reserved blocks up to date
    return PoolSnapshot(manager.block_size, ref_counts, block_owners(manager),
                        {seq_id: manager.get_block_table(seq_id) for seq_id in manager.sequences},
                        {seq_id: manager.get_sequence_length(seq_id) for seq_id in manager.sequences},
                        manager.cached_blocks(),
                        manager.num_free_blocks, cache_keys=list(manager.prefix_cache.block_keys))


EVENT_KINDS = {"shared": "fork or prefix hit: a new sequence shares the block",
               "copy-on-write": "copy-on-write: a sequence wrote to a shared block and got this copy",
               "evicted": "evicted from the prefix cache (its content dropped for a new use)",
               "swapped out": "freed by a sequence swapped out to the host pool"}


@dataclass(slots=True)
class PoolEvent:
    """Something that happened to ``block`` between two frames (``kind``: a key of ``EVENT_KINDS``), and the
    sequence it happened for (None for an eviction)."""

    kind: str
    block: int
    seq_id: object = None


def pool_events(before: PoolSnapshot, after: PoolSnapshot) -> list[PoolEvent]:
    """What changed in the pool from ``before`` to ``after`` (two snapshots of one pool), read from their block
    tables: a new sequence holding a block someone held before (a fork's shared blocks, or a prefix-cache hit); a
    sequence whose logical block moved from a shared block to another (copy-on-write); a block whose prefix-cache
    key was dropped or replaced (evicted; without keys, a block cached before and not after); a sequence that left the device pool for the host pool (swapped
    out: the blocks it freed). Events between the two frames that the later one no longer shows are not seen."""
    events = []
    for seq_id, table in after.block_tables.items():
        old = before.block_tables.get(seq_id)
        if old is None:
            events += [PoolEvent("shared", block, seq_id) for block in table if before.ref_counts[block] > 0]
            continue
        events += [PoolEvent("copy-on-write", new, seq_id) for was, new in zip(old, table)
                   if was != new and before.ref_counts[was] > 1]
    if before.cache_keys is not None and after.cache_keys is not None:  # dropped, or replaced by other content
        events += [PoolEvent("evicted", block) for block, (was, now) in
                   enumerate(zip(before.cache_keys, after.cache_keys)) if was is not None and now != was]
    else:
        events += [PoolEvent("evicted", block) for block, (was, now) in enumerate(zip(before.cached, after.cached))
                   if was and not now]
    host = after.host_pool
    if host is not None:
        for seq_id, table in before.block_tables.items():
            if seq_id not in after.block_tables and seq_id in host.block_tables:
                events += [PoolEvent("swapped out", block, seq_id) for block in table]
    return events


def pool_occupancy(frames: list[tuple[int, PoolSnapshot]]) -> list[dict]:
    """Per frame (``(iteration, snapshot)``): blocks in use, shared (ref count > 1), free but still cached (a later
    prompt may hit them) and free, for an occupancy chart."""
    rows = []
    for iteration, pool in frames:
        used = sum(count > 0 for count in pool.ref_counts)
        cached_free = sum(cached and not count for cached, count in zip(pool.cached, pool.ref_counts))
        rows.append({"iteration": iteration, "blocks_in_use": used,
                     "shared_blocks": sum(count > 1 for count in pool.ref_counts),
                     "cached_free_blocks": cached_free, "free_blocks": pool.num_free_blocks,
                     "num_blocks": len(pool.ref_counts)})
    return rows
