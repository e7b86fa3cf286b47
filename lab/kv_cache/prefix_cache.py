"""The prefix cache: full KV blocks found again by their content.

A full block is keyed by ``(parent_content_id, token_ids)``: the content id of the block before it (a serial number
given to each distinct cached prefix, never reused) and its own tokens. The cache is a dict on that key, so the hash
chains over the whole prefix while the lookup compares the key itself: a hash collision can never hand back a block
with other contents. A caller that does not have the tokens but knows that a prompt's content is a function of
(``stream_key``, position) keys its block ``j`` by (parent content id, stream key, ``j``) instead: O(1) per block
(the simulator's unshared prompts).

The cache only remembers which block holds which content. Who holds a block, and when a block is reused, is the
block manager's (``lab.kv_cache.block_manager``): it asks ``lookup`` before allocating, ``register`` as blocks fill, and
``evict`` when the free queue hands a cached block to a new owner.

With an offload tier below it (``lab.kv_cache.offload``), an evicted prompt block's contents go to the tier (a store copy is
queued), ``tier_hits`` finds the blocks after the GPU hits that the tier holds, and ``register_loaded`` caches the
fresh GPU blocks they are loaded into (a load copy queued). ``take_tier_copies`` hands the step's copies over.
"""
from __future__ import annotations

from dataclasses import dataclass

from .offload import OffloadCopies, OffloadTier

ROOT_CONTENT_ID = -1  # the content id "before" a sequence's first block
STREAM = object()  # marks a block key made from a stream key instead of token ids


@dataclass(slots=True)
class PrefixCacheStats:
    """Counters of prefix-cache lookups, in blocks and tokens."""

    queried_blocks: int = 0
    hit_blocks: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.queried_blocks if self.queried_blocks else 0.0


class PrefixCache:
    """Full blocks of ``block_size`` tokens of a pool of ``num_blocks``, by content. ``enabled`` False: token
    lookups find nothing and token registrations keep nothing (stream keys are the caller's to withhold)."""

    __slots__ = ("block_size", "enabled", "blocks", "copies", "block_keys", "content_ids", "next_content_id", "stats",
                 "prompt_blocks", "tier", "tier_stores", "tier_loads")

    def __init__(self, num_blocks: int, block_size: int, enabled: bool, tier: OffloadTier | None = None):
        self.block_size, self.enabled = block_size, enabled
        self.blocks: dict[tuple, int] = {}  # key -> block id (the one a lookup hits)
        # key -> later blocks filled with the same content (two requests computed it at once): still cached, so when
        # the first is reused the next takes its place, as vLLM keeps every block of a hash (BlockHashToBlockMap,
        # vllm/v1/core/block_pool.py) and hits the first inserted that is left
        self.copies: dict[tuple, list[int]] = {}
        self.block_keys: list[tuple | None] = [None] * num_blocks  # block id -> its key, None when not cached
        self.content_ids: list[int] = [ROOT_CONTENT_ID] * num_blocks  # block id -> content id of its prefix
        self.next_content_id = 0
        self.stats = PrefixCacheStats()
        # block id -> cached as part of a prompt (not filled by decoding): what the offload tier keeps, so that the
        # engine (which knows generated tokens) and the simulator (which does not) offload the same blocks
        self.prompt_blocks: list[bool] = [False] * num_blocks
        self.tier = tier
        self.tier_stores: list[tuple[int, int]] = []  # (device block, host slot) copies queued this step
        self.tier_loads: list[tuple[int, int]] = []  # (host slot, device block)

    def __len__(self) -> int:
        """Blocks cached (copies of one content included)."""
        return len(self.blocks) + sum(map(len, self.copies.values()))

    def is_cached(self, block: int) -> bool:
        return self.block_keys[block] is not None

    def lookup(self, token_ids: list[int]) -> list[int]:
        """Cached blocks of the longest cached prefix of ``token_ids``, leaving at least the last token uncached."""
        if not self.enabled:
            return []
        hits, parent, size, blocks, content_ids = [], ROOT_CONTENT_ID, self.block_size, self.blocks, self.content_ids
        for start in range(0, len(token_ids) - size, size):
            block = blocks.get((parent, tuple(token_ids[start:start + size])))  # token_key, inlined
            if block is None:
                break
            hits.append(block)
            parent = content_ids[block]
        return hits

    def has_stream(self, stream_key) -> bool:
        """Whether the stream's first block is cached (without it no block of the stream can hit)."""
        return (ROOT_CONTENT_ID, STREAM, stream_key, 0) in self.blocks

    def lookup_stream(self, stream_key, num_tokens: int) -> list[int]:
        """Cached blocks of the stream's leading full blocks, leaving at least the last of ``num_tokens`` uncached."""
        hits, parent, blocks, content_ids = [], ROOT_CONTENT_ID, self.blocks, self.content_ids
        for index in range((num_tokens - 1) // self.block_size):
            block = blocks.get((parent, STREAM, stream_key, index))
            if block is None:
                break
            hits.append(block)
            parent = content_ids[block]
        return hits

    @staticmethod
    def token_key(parent_content_id: int, tokens) -> tuple:
        """The key of a full block of ``tokens`` after the prefix ``parent_content_id``."""
        return parent_content_id, tuple(tokens)

    @staticmethod
    def stream_key(parent_content_id: int, stream_key, index: int) -> tuple:
        """The key of a stream's full block ``index``."""
        return parent_content_id, STREAM, stream_key, index

    def tier_hits(self, hits: list[int], num_tokens: int, token_ids, stream_key) -> list[tuple]:
        """Keys of the full blocks after the GPU ``hits`` that the tier holds, in order, up to the first miss (the
        last prompt token is never served from a cache); by tokens, or by stream position when ``token_ids`` is
        None."""
        size, tier, keys = self.block_size, self.tier, []
        parent = self.content_ids[hits[-1]] if hits else ROOT_CONTENT_ID
        for index in range(len(hits), (num_tokens - 1) // size):
            key = self.token_key(parent, token_ids[index * size:(index + 1) * size]) if token_ids is not None \
                else self.stream_key(parent, stream_key, index)
            entry = tier.get(key)
            if entry is None:
                break
            keys.append(key)
            parent = entry[1]
        return keys

    def register_loaded(self, keys: list[tuple], slots: list[int], blocks) -> None:
        """Cache the fresh ``blocks`` that the tier's ``slots`` (taken for ``keys``) are loaded into, under the same
        keys and content ids (the keys of the blocks after them chain on those ids), and queue the loads."""
        tier = self.tier
        for key, slot, block in zip(keys, slots, blocks):
            self.blocks[key] = block
            self.block_keys[block] = key
            self.content_ids[block] = tier.get(key)[1]
            self.prompt_blocks[block] = True
            self.tier_loads.append((slot, block))

    @property
    def has_tier_copies(self) -> bool:
        """Whether copies to or from the tier are queued."""
        return bool(self.tier_stores or self.tier_loads)

    def take_tier_copies(self) -> OffloadCopies:
        """The copies queued since the last call; the tier's slots may be reused from now on."""
        copies = OffloadCopies(self.tier_stores, self.tier_loads)
        self.tier_stores, self.tier_loads = [], []
        if self.tier is not None:
            self.tier.unpin()
        return copies

    def register(self, parent_content_id: int, block: int, tokens, prompt: bool = False) -> int:
        """Cache ``block``, just filled with ``tokens`` after the prefix ``parent_content_id`` (``prompt``: as part
        of a prompt), unless a block with that content is cached already; returns the content id the next block of
        the sequence chains on."""
        if not self.enabled:
            return parent_content_id
        return self._register((parent_content_id, tuple(tokens)), block, prompt)

    def register_stream(self, parent_content_id: int, stream_key, table, first: int, end: int,
                        prompt: bool = True) -> int:
        """Cache the stream's full blocks ``first <= j < end`` (``table[j]``) under stream keys (``prompt``: as part of
        a prompt, else sampled); returns the content id after the last."""
        parent = parent_content_id
        for index in range(first, end):
            parent = self._register((parent, STREAM, stream_key, index), table[index], prompt)
        return parent

    def _register(self, key: tuple, block: int, prompt: bool) -> int:
        cached = self.blocks.get(key)
        if cached is None:
            cached = self.blocks[key] = block
            self.block_keys[block] = key
            self.content_ids[block] = self.next_content_id
            self.prompt_blocks[block] = prompt
            self.next_content_id += 1
        elif cached != block and self.block_keys[block] is None:
            self.copies.setdefault(key, []).append(block)
            self.block_keys[block] = key
            self.content_ids[block] = self.content_ids[cached]
            self.prompt_blocks[block] = prompt
        return self.content_ids[cached]

    def evict(self, block: int) -> None:
        """Forget ``block``'s content (it is being reused): another copy of it takes its place, or else a prompt
        block's contents go to the tier first."""
        key = self.block_keys[block]
        copies = self.copies.get(key)
        if copies is not None:
            if self.blocks[key] == block:
                self.blocks[key] = copies.pop(0)
            else:
                copies.remove(block)
            if not copies:
                del self.copies[key]
        else:
            if self.tier is not None and self.prompt_blocks[block]:
                slot = self.tier.store(key, self.content_ids[block])
                if slot is not None:
                    self.tier_stores.append((block, slot))
            del self.blocks[key]
        self.block_keys[block] = None
        self.content_ids[block] = ROOT_CONTENT_ID
        self.prompt_blocks[block] = False

    def check(self) -> None:
        """Raise ``AssertionError`` when a cache entry and its block's key disagree."""
        for key, block in self.blocks.items():
            assert self.block_keys[block] == key, f"cache entry of block {block} disagrees with its key"
        for key, blocks in self.copies.items():
            assert key in self.blocks and blocks, f"copies of a content that is not cached: {blocks}"
            for block in blocks:
                assert self.block_keys[block] == key and block != self.blocks[key], f"copy {block} disagrees"

    def check_tokens(self, name, table, known_tokens: list[int]) -> None:
        """Raise ``AssertionError`` unless every cached full block of ``table`` whose tokens are ``known_tokens`` is
        keyed by exactly those tokens, after the content of the block before it."""
        size, keys, content_ids = self.block_size, self.block_keys, self.content_ids
        for index, block in enumerate(table[:len(known_tokens) // size]):
            key = keys[block]
            if key is None or key[1] is STREAM:
                continue
            tokens = tuple(known_tokens[index * size:(index + 1) * size])
            assert key[1] == tokens, f"{name!r}: block {block} is cached under other tokens than it holds"
            previous = table[index - 1] if index else None
            if previous is None or keys[previous] is not None:
                parent = ROOT_CONTENT_ID if previous is None else content_ids[previous]
                assert key[0] == parent, f"{name!r}: block {block} is cached after another prefix"
