"""A host-memory tier below the GPU prefix cache (vLLM V1's KV offloading, SGLang's HiCache host level).

When the GPU pool reuses a full block that the prefix cache still knew (its last holder released it long ago), the
block's contents are copied to a host slot first, keyed by the same content key; a later prompt whose prefix misses
on the GPU but hits here gets a fresh GPU block loaded back over the host link instead of a recomputed prefill.

Store policy: **on eviction** (vLLM's CPU offloading connector stores blocks as they are computed, write-through; a
block that is hit again before it is evicted then costs a copy for nothing, and a prompt's blocks cost a copy each
whether or not anyone asks for them again). Storing on eviction copies only what the GPU is about to lose, once.
Eviction in the tier: least recently used (stored or loaded). Slots with a copy queued in this step are pinned, so
a store never overwrites a slot a load of the same step still has to read.

One host budget: with a host pool for swap preemption, the tier's slots are that pool's blocks, borrowed while free
(``KVBlockManager.lend_block``). Swapped-out sequences come first: a swap-out that needs blocks the tier holds
evicts the tier's least recently used entries (``make_room``); the tier uses whatever the swapped sequences leave.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple, Protocol


@dataclass(slots=True)
class OffloadStats:
    """Blocks the tier served to prefix lookups, loaded to the GPU, stored from it, and its peak occupancy."""

    hit_blocks: int = 0
    loaded_blocks: int = 0
    stored_blocks: int = 0
    peak_blocks: int = 0


class OffloadCopies(NamedTuple):
    """The tier's copies queued in a step, for the executor: stores run before anything writes the device pool,
    loads before the forward reads it."""

    stores: list[tuple[int, int]]  # (device block, host slot)
    loads: list[tuple[int, int]]  # (host slot, device block)


class HostPool(Protocol):
    """What the tier needs of the host pool it shares (``KVBlockManager``)."""

    num_physical_blocks: int
    num_free_blocks: int

    def lend_block(self) -> int | None: ...
    def return_block(self, block: int) -> None: ...


class OffloadTier:
    """``capacity`` host slots (None: unbounded), LRU; or, with ``host``, the free blocks of that host pool (its
    size is then the capacity). Entries: content key -> (slot, content id)."""

    def __init__(self, capacity: int | None, host: HostPool | None = None):
        self.host = host
        self.capacity = host.num_physical_blocks if host is not None else capacity
        self.entries: OrderedDict[tuple, tuple[int, int]] = OrderedDict()
        self.free_slots: list[int] = list(range(capacity - 1, -1, -1)) if capacity and host is None else []
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
        entries = self.entries
        if key in entries:
            entries.move_to_end(key)
            return None
        if self.free_slots:
            slot = self.free_slots.pop()
        elif self.capacity is None:
            slot, self.next_slot = self.next_slot, self.next_slot + 1
        elif self.host is not None and self.host.num_free_blocks:
            slot = self.host.lend_block()
        else:
            slot = self._evict()
            if slot is None:
                return None
        entries[key] = (slot, content_id)
        self.pinned.add(slot)
        stats = self.stats
        stats.stored_blocks += 1
        if len(entries) > stats.peak_blocks:
            stats.peak_blocks = len(entries)
        return slot

    @property
    def num_evictable(self) -> int:
        """Entries a swap-out may take the slots of now (not pinned by this step's copies)."""
        return len(self.entries) - len(self.pinned)

    def make_room(self, count: int) -> None:
        """Give ``count`` slots back to the host pool, least recently used first (the caller checked
        ``num_evictable``): swapped-out sequences need them."""
        for _ in range(count):
            self.host.return_block(self._evict())

    def unpin(self) -> None:
        """The step's copies are queued in order: slots may be reused from the next step on."""
        self.pinned.clear()

    def _evict(self) -> int | None:
        """Drop the least recently used entry whose slot is not pinned; its slot (None when all are pinned, or the
        tier holds nothing: swapped-out sequences have the whole shared host pool)."""
        entries, pinned = self.entries, self.pinned
        if not entries:
            return None
        key, (slot, content_id) = entries.popitem(last=False)
        if slot not in pinned:
            return slot
        entries[key] = (slot, content_id)  # pinned (rare: a copy of this step uses it): look further
        entries.move_to_end(key, last=False)
        for key, (slot, _) in entries.items():
            if slot not in pinned:
                del entries[key]
                return slot
        return None
