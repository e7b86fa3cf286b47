"""A host-memory tier below the GPU prefix cache (vLLM V1's KV offloading, SGLang's HiCache host level).

When the GPU pool reuses a full block that the prefix cache still knew (its last holder released it long ago), the
block's contents are copied to a host slot first, keyed by the same content key; a later prompt whose prefix misses
on the GPU but hits here gets a fresh GPU block loaded back over the host link instead of a recomputed prefill.

Store policy: **on eviction** (vLLM's CPU offloading connector stores blocks as they are computed, write-through; a
block that is hit again before it is evicted then costs a copy for nothing, and a prompt's blocks cost a copy each
whether or not anyone asks for them again). Storing on eviction copies only what the GPU is about to lose, once.
Eviction in the tier: least recently used (stored or loaded). Slots with a copy queued in this step are pinned, so
a store never overwrites a slot a load of the same step still has to read.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True)
class OffloadStats:
    """Blocks the tier served to prefix lookups, loaded to the GPU, stored from it, and its peak occupancy."""

    hit_blocks: int = 0
    loaded_blocks: int = 0
    stored_blocks: int = 0
    peak_blocks: int = 0


class OffloadTier:
    """``capacity`` host slots (None: unbounded), LRU. Entries: content key -> (slot, content id)."""

    def __init__(self, capacity: int | None):
        self.capacity = capacity
        self.entries: OrderedDict[tuple, tuple[int, int]] = OrderedDict()
        self.free_slots: list[int] = list(range(capacity - 1, -1, -1)) if capacity is not None else []
        self.next_slot = 0  # unbounded: slots are numbered as they are first used
        self.pinned: set[int] = set()
        self.stats = OffloadStats()

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key: tuple) -> tuple[int, int] | None:
        """``(slot, content id)`` of a stored block, without touching its recency (a lookup that may not commit)."""
        return self.entries.get(key)

    def take(self, key: tuple) -> int:
        """A lookup commits: the block is loaded from its slot this step (pinned, most recently used)."""
        slot, _ = self.entries[key]
        self.entries.move_to_end(key)
        self.pinned.add(slot)
        self.stats.hit_blocks += 1
        self.stats.loaded_blocks += 1
        return slot

    def store(self, key: tuple, content_id: int) -> int | None:
        """Keep the contents of a block the GPU is about to reuse; the slot to copy them to, or None when the tier
        already holds them (or every slot is pinned this step)."""
        if key in self.entries:
            self.entries.move_to_end(key)
            return None
        slot = self._free_slot()
        if slot is None:
            return None
        self.entries[key] = (slot, content_id)
        self.pinned.add(slot)
        self.stats.stored_blocks += 1
        self.stats.peak_blocks = max(self.stats.peak_blocks, len(self.entries))
        return slot

    def unpin(self) -> None:
        """The step's copies are queued in order: slots may be reused from the next step on."""
        self.pinned.clear()

    def _free_slot(self) -> int | None:
        if self.capacity is None:
            self.next_slot += 1
            return self.next_slot - 1
        if self.free_slots:
            return self.free_slots.pop()
        for key, (slot, _) in self.entries.items():  # least recently used first
            if slot not in self.pinned:
                del self.entries[key]
                return slot
        return None
