"""KV allocation policies the simulator compares.

Contiguous policies reserve one region per sequence in a real linear address space of ``capacity_tokens`` slots,
managed first-fit or as a buddy system, so external fragmentation emerges from the order of allocations and frees.
The paged policy is the engine's own, ``lab.sched.kv_policy.PagedPolicy`` (it drives ``KVBlockManager``); both follow
``lab.sched.scheduler.KVPolicy``.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

from lab.errors import InputError
from lab.sched.scheduler import MemoryNeeds, MemorySample
from lab.sched.kv_policy import PagedPolicy  # noqa: F401  (re-exported: the simulator's policies in one place)
from lab.sched.scheduler import NO_EVENT

CONTIGUOUS_KINDS = ("contiguous-max", "contiguous-pow2", "contiguous-oracle", "contiguous-grow",
                    "contiguous-pow2-total")
ALLOCATORS = (*CONTIGUOUS_KINDS, "paged")


# ---- address spaces ------------------------------------------------------------------------------------------------
class FirstFitSpace:
    """Free holes of a linear address space, sorted by start; allocation takes the first hole that fits."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.hole_starts: list[int] = [0]
        self.hole_sizes: dict[int, int] = {0: capacity}
        self.num_free = capacity
        self._largest: int | None = capacity

    def allocate(self, size: int) -> tuple[int, int] | None:
        """``(start, size)`` of a new region, or None when no hole is large enough."""
        for index, start in enumerate(self.hole_starts):
            hole = self.hole_sizes[start]
            if hole >= size:
                del self.hole_sizes[start]
                if hole > size:
                    self.hole_starts[index] = start + size
                    self.hole_sizes[start + size] = hole - size
                else:
                    del self.hole_starts[index]
                self.num_free -= size
                self._largest = None
                return start, size
        return None

    def free(self, start: int, size: int) -> None:
        """Return a region, merging it with adjacent holes."""
        self.num_free += size
        self._largest = None
        index = bisect.bisect_left(self.hole_starts, start)
        if index < len(self.hole_starts) and self.hole_starts[index] == start + size:  # merge with the next hole
            size += self.hole_sizes.pop(self.hole_starts.pop(index))
        if index > 0:
            previous = self.hole_starts[index - 1]
            if previous + self.hole_sizes[previous] == start:  # merge into the previous hole
                self.hole_sizes[previous] += size
                return
        self.hole_starts.insert(index, start)
        self.hole_sizes[start] = size

    def max_region(self) -> int:
        """The largest region this space can ever hand out."""
        return self.capacity

    @staticmethod
    def rounded(size: int) -> int:
        """The size a request of ``size`` slots really takes."""
        return size

    def largest_free(self) -> int:
        """Size of the largest hole."""
        if self._largest is None:
            self._largest = max(self.hole_sizes.values(), default=0)
        return self._largest

    def regions_free(self) -> list[tuple[int, int]]:
        return [(s, self.hole_sizes[s]) for s in self.hole_starts]


class BuddySpace:
    """Buddy allocator: regions are powers of two, split on demand and merged with their free buddy on release.
    A capacity that is not a power of two is covered by aligned power-of-two roots (its binary digits)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.free_by_order: dict[int, set[int]] = {}
        self.num_free = capacity
        start = 0
        for order in range(capacity.bit_length() - 1, -1, -1):
            if capacity & (1 << order):
                self.free_by_order.setdefault(order, set()).add(start)
                start += 1 << order

    def allocate(self, size: int) -> tuple[int, int] | None:
        order = max(size - 1, 0).bit_length()
        source = next((o for o in sorted(self.free_by_order) if o >= order and self.free_by_order[o]), None)
        if source is None:
            return None
        start = self.free_by_order[source].pop()
        while source > order:  # split, keeping the lower half
            source -= 1
            self.free_by_order.setdefault(source, set()).add(start + (1 << source))
        self.num_free -= 1 << order
        return start, 1 << order

    def free(self, start: int, size: int) -> None:
        order = size.bit_length() - 1
        self.num_free += size
        while True:
            buddy = start ^ (1 << order)
            peers = self.free_by_order.get(order)
            if not peers or buddy not in peers:
                break
            peers.remove(buddy)
            start, order = min(start, buddy), order + 1
        self.free_by_order.setdefault(order, set()).add(start)

    def max_region(self) -> int:
        """The largest root block: the largest region this space can ever hand out."""
        return 1 << (self.capacity.bit_length() - 1)

    @staticmethod
    def rounded(size: int) -> int:
        """The power of two a request of ``size`` slots really takes."""
        return 1 << max(size - 1, 0).bit_length()

    def largest_free(self) -> int:
        """Size of the largest free block (the largest region an allocation can get)."""
        return max((1 << o for o, starts in self.free_by_order.items() if starts), default=0)

    def regions_free(self) -> list[tuple[int, int]]:
        return sorted((s, 1 << o) for o, starts in self.free_by_order.items() for s in starts)


ADDRESS_SPACES = ("first-fit", "buddy")


def make_space(kind: str, capacity: int):
    """``first-fit`` or ``buddy`` address space."""
    if kind == "first-fit":
        return FirstFitSpace(capacity)
    if kind == "buddy":
        return BuddySpace(capacity)
    raise InputError(f"address_space must be 'first-fit' or 'buddy'; got {kind!r}")


# ---- policies --------------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class Usage:
    """Aggregates a policy keeps in O(1) per event, in token slots."""

    allocated: int = 0
    will_fill: int = 0  # sum over sequences of min(allocated to it, its final length)
    never_filled: int = 0  # sum over sequences of slots it holds that it will never fill


class ContiguousPolicy:
    """One region per sequence: ``max`` reserves max_model_len, ``pow2`` the prompt plus the output length rounded
    up to a power of two (the vLLM paper's Orca (Pow2): outputs over-reserved by at most 2x; ``pow2-total`` rounds
    prompt + output instead), ``oracle`` exactly prompt + output, ``grow`` starts at prompt + ``grow_initial_extra`` and doubles by
    copying into a new region when it overflows."""

    supports_swap = False
    caches_prefixes = False
    pending_offload = False  # no prefix cache, so no tier below it
    block_period = 0  # no periodic needs: a region grows only at its own events
    reserves_by_count = False  # reserve() is never asked (no periodic needs)
    pending_copies = ()  # nothing is ever copied on write

    def __init__(self, kind: str, capacity_tokens: int, max_model_len: int, address_space: str = "first-fit",
                 grow_initial_extra: int = 16):
        if kind not in CONTIGUOUS_KINDS:
            raise InputError(f"unknown contiguous allocator {kind!r}")
        self.kind, self.max_model_len, self.grow_initial_extra = kind, max_model_len, grow_initial_extra
        self.space = make_space(address_space, capacity_tokens)
        self.capacity = capacity_tokens
        self.usage = Usage()
        self.copied_tokens = 0

    def initial_size(self, prompt_len: int, final_len: int) -> int:
        if self.kind == "contiguous-max":
            return self.max_model_len
        if self.kind == "contiguous-pow2":  # prompt + the output rounded up: output = final_len - prompt + 1
            return prompt_len + (1 << max(final_len - prompt_len, 0).bit_length())
        if self.kind == "contiguous-pow2-total":
            return 1 << max(final_len - 1, 0).bit_length()
        if self.kind == "contiguous-oracle":
            return final_len
        return min(prompt_len + self.grow_initial_extra, self.max_model_len, self.space.max_region())

    def can_ever_fit(self, final_len: int, count: int = 1) -> bool:
        """Whether ``count`` regions that reach ``final_len`` fit the largest free region of an empty space."""
        size = max(self.space.rounded(self.initial_size(final_len, final_len)), final_len)
        return count * size <= self.space.max_region()

    def can_ever_admit(self, prompt_len: int, final_len: int, count: int, first_decode: bool) -> bool:
        """Whether ``admit`` could place a group of ``count`` samples into an empty space (a region each, at once)."""
        size = max(self.space.rounded(self.initial_size(prompt_len, final_len)), prompt_len)
        return count * size <= self.space.max_region()

    def admit(self, seqs: list, token_ids=None, first_decode: bool = True, chunk: int | None = None,
              whole_must_fit: bool = False) -> bool:
        """Reserve a region for every sequence of a group, or none of them (``token_ids``, ``first_decode``,
        ``chunk`` and ``whole_must_fit`` are not used: a region holds the whole prompt and its first decode)."""
        placed = []
        for seq in seqs:
            region = self.space.allocate(self.initial_size(seq.prompt_len, seq.final_len))
            if region is None:
                for done in placed:
                    self._free(done)
                return False
            seq.region, seq.synced_len = region, seq.prompt_len  # the scheduler never grows a prompt in a region
            self._account(seq, +1)
            placed.append(seq)
        return True

    def memory_needs(self, seq) -> MemoryNeeds:
        """The KV length at which ``seq`` next needs more memory (grow only), and no periodic needs."""
        if self.kind != "contiguous-grow" or seq.region[1] >= seq.final_len:
            return MemoryNeeds(NO_EVENT, NO_EVENT)
        return MemoryNeeds(seq.region[1] + 1, NO_EVENT)

    def reserve(self, count: int) -> bool:
        return False

    def final_block_reserved(self, seq) -> int:
        """Never called: contiguous policies have no periodic needs."""
        return 0

    def grow(self, seq, kv_len: int, alone: bool = False) -> bool:
        """Grow by copying into a region twice as large (capped by the largest region the space can hold); False
        (nothing changed) when no such region is free. ``alone``: no
        other sequence holds memory, so the old region is released first (as a swap out and back in would) and the
        growth cannot fail."""
        new_size = min(2 * seq.region[1], max(self.max_model_len, seq.final_len), self.space.max_region())
        if alone:
            self._free(seq)
            region = self.space.allocate(new_size)
            self.copied_tokens += kv_len - 1  # out and back in: charged as a second copy below
        else:
            region = self.space.allocate(new_size)
            if region is None:
                return False
            self._free(seq)
        seq.region = region
        self._account(seq, +1)
        self.copied_tokens += kv_len - 1
        return True

    def sync(self, seq, kv_len: int) -> None:
        """Nothing to tell: a region holds whatever the sequence writes into it."""

    sync_slots = sync

    def release(self, seq, kv_len: int = 0) -> None:
        self._free(seq)

    def refork(self, parent, child, kv_len: int) -> None:
        """Beam search without sharing: ``child``'s region is overwritten by a copy of ``parent``'s ``kv_len - 1``
        tokens (charged as copy time)."""
        self.copied_tokens += kv_len - 1

    preempt = release

    def blocks_in_use(self) -> int:
        """Allocated token slots (contiguous allocators have no blocks)."""
        return self.usage.allocated

    def cpu_blocks_in_use(self) -> int:
        return 0

    tier_blocks_in_use = cpu_blocks_in_use

    def num_free_blocks(self) -> int:
        return self.space.num_free

    def take_copies(self) -> list:
        return []

    def can_swap_out(self, seqs, kv_lens) -> bool:
        return False

    def swap_out(self, seqs, kv_lens):
        raise NotImplementedError("contiguous allocators recompute")

    can_swap_in = swap_in = first_decode_blocks = swap_out

    def _free(self, seq) -> None:
        self._account(seq, -1)
        self.space.free(*seq.region)
        seq.region = None

    def _account(self, seq, sign: int) -> None:
        size = seq.region[1]
        self.usage.allocated += sign * size
        self.usage.will_fill += sign * min(size, seq.final_len)
        self.usage.never_filled += sign * max(0, size - seq.final_len)

    def memory_sample(self, held_tokens: int) -> MemorySample:
        """The categories in slots given the tokens held, and the slots the sequences hold (nothing is shared: the
        allocated slots)."""
        usage, space = self.usage, self.space
        external = space.num_free - space.largest_free()
        return MemorySample(held_tokens, usage.will_fill - held_tokens, usage.never_filled, external,
                            self.capacity - usage.allocated - external, usage.allocated)

    def host_capacity_tokens(self) -> int:
        return 0  # contiguous allocators recompute: no host pool

    def prefix_cache_stats(self) -> None:
        return None

    def offload_stats(self) -> None:
        return None

    def describe_pool(self, snapshot, running: dict) -> None:
        """The address space's free regions and each running sequence's region."""
        snapshot.free_regions = self.space.regions_free()
        snapshot.regions = {seq_id: seq.region for seq_id, seq in running.items()}
