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
                        manager.num_free_blocks)
