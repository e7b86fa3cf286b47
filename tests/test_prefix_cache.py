"""The prefix cache on its own: content keys chain over the whole prefix, a lookup never returns a block with other
contents, the last token is never served, stream keys, eviction, disabled caches, and its checks."""
import pytest
from hypothesis import given, settings, strategies as st

from lab.kv_cache.offload import OffloadTier
from lab.kv_cache.prefix_cache import ROOT_CONTENT_ID, PrefixCache


def filled(cache: PrefixCache, tokens: list[int], table: list[int]) -> int:
    """Register ``tokens``' full blocks into ``table``'s blocks, as a sequence filling them would."""
    parent, size = ROOT_CONTENT_ID, cache.block_size
    for index in range(len(tokens) // size):
        parent = cache.register(parent, table[index], tokens[index * size:(index + 1) * size])
    return parent


def test_a_prompt_finds_its_cached_prefix_and_never_its_last_token():
    cache = PrefixCache(8, 2, True)
    filled(cache, [1, 2, 3, 4, 5, 6], [0, 1, 2])
    assert cache.lookup([1, 2, 3, 4, 9]) == [0, 1]
    assert cache.lookup([1, 2, 3, 4]) == [0]  # the block holding the last token is computed again
    assert cache.lookup([1, 2, 3, 4, 5, 6, 7]) == [0, 1, 2] and len(cache) == 3


def test_a_block_is_found_only_after_the_same_prefix():
    cache = PrefixCache(8, 2, True)
    filled(cache, [1, 2, 3, 4], [0, 1])
    assert cache.lookup([9, 9, 3, 4, 5]) == []  # the same tokens after another prefix are other content
    filled(cache, [9, 9, 3, 4], [2, 3])
    assert cache.lookup([9, 9, 3, 4, 5]) == [2, 3] and cache.lookup([1, 2, 3, 4, 5]) == [0, 1]


def test_registering_known_content_chains_on_the_cached_block():
    cache = PrefixCache(8, 2, True)
    first = filled(cache, [1, 2, 3, 4], [0, 1])
    again = filled(cache, [1, 2, 3, 4], [5, 6])  # a second copy of the same content: cached, chained on the first
    assert first == again and len(cache) == 4 and cache.is_cached(5)
    assert cache.lookup([1, 2, 3, 4, 9]) == [0, 1]
    cache.check()


def test_a_copy_of_an_evicted_block_takes_its_place():
    """Two requests computed the same prompt at once: reusing the first copy leaves the second findable (vLLM keeps
    every block of a hash: a preempted request hit only its first block here, vLLM all of them)."""
    cache = PrefixCache(8, 2, True)
    filled(cache, [1, 2, 3, 4], [0, 1])
    filled(cache, [1, 2, 3, 4], [5, 6])
    cache.evict(1)
    assert cache.lookup([1, 2, 3, 4, 9]) == [0, 6]
    cache.evict(6)
    assert cache.lookup([1, 2, 3, 4, 9]) == [0] and not cache.is_cached(6)
    cache.evict(5)
    assert cache.lookup([1, 2, 3, 4, 9]) == [0] and len(cache) == 1
    cache.check()


def test_eviction_forgets_a_block_and_what_chains_on_it_misses():
    cache = PrefixCache(8, 2, True)
    filled(cache, [1, 2, 3, 4, 5, 6], [0, 1, 2])
    cache.evict(1)
    assert not cache.is_cached(1) and cache.lookup([1, 2, 3, 4, 5, 6, 7]) == [0]
    cache.check()


def test_an_evicted_prompt_block_goes_to_the_tier_and_comes_back_under_its_key():
    cache = PrefixCache(8, 2, True, OffloadTier(4))
    parent = ROOT_CONTENT_ID
    for index, block in enumerate([0, 1, 2]):  # a prompt's blocks
        parent = cache.register(parent, block, [1, 2, 3, 4, 5, 6][2 * index:2 * index + 2], prompt=True)
    cache.register(parent, 3, [7, 8])  # a block filled by decoding: never stored
    cache.evict(3)
    cache.evict(1)
    cache.evict(2)
    assert cache.has_tier_copies and cache.lookup([1, 2, 3, 4, 5, 6, 7]) == [0]
    copies = cache.take_tier_copies()
    assert [block for block, _ in copies.stores] == [1, 2] and copies.loads == [] and not cache.has_tier_copies
    keys = cache.tier_hits([0], 7, [1, 2, 3, 4, 5, 6, 7], None)
    assert len(keys) == 2 and cache.tier_hits([0], 6, [1, 2, 3, 4, 5, 6], None) == keys[:1]  # never the last token
    slots = [cache.tier.take(key) for key in keys]
    assert slots == [slot for _, slot in copies.stores]
    cache.register_loaded(keys, slots, [6, 7])  # fresh blocks: the tier's contents, the same keys and content ids
    assert cache.lookup([1, 2, 3, 4, 5, 6, 9]) == [0, 6, 7]
    assert cache.take_tier_copies().loads == list(zip(slots, [6, 7]))
    cache.check()
    cache.check_tokens("prompt", [0, 6, 7], [1, 2, 3, 4, 5, 6])


def test_stream_keys_hit_by_position_without_tokens():
    cache = PrefixCache(8, 4, True)
    assert not cache.has_stream("s")
    cache.register_stream(ROOT_CONTENT_ID, "s", [3, 5, 6], 0, 2)
    assert cache.has_stream("s") and cache.lookup_stream("s", 9) == [3, 5] and cache.lookup_stream("s", 8) == [3]
    assert cache.lookup_stream("t", 9) == []


def test_a_disabled_cache_keeps_nothing():
    cache = PrefixCache(4, 2, False)
    assert filled(cache, [1, 2, 3, 4], [0, 1]) == ROOT_CONTENT_ID and len(cache) == 0
    assert cache.lookup([1, 2, 3, 4, 5]) == []


def test_the_checks_catch_a_key_that_names_other_tokens():
    cache = PrefixCache(4, 2, True)
    filled(cache, [1, 2, 3, 4], [0, 1])
    cache.check_tokens("a", [0, 1], [1, 2, 3, 4])
    with pytest.raises(AssertionError, match="cached under other tokens"):
        cache.check_tokens("a", [0, 1], [1, 2, 9, 9])
    cache.blocks[(ROOT_CONTENT_ID, (7, 7))] = 0
    with pytest.raises(AssertionError, match="disagrees with its key"):
        cache.check()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=6),
       st.integers(1, 4))
def test_every_hit_holds_exactly_the_prompt_s_tokens(prompts, block_size):
    """Against a reference that remembers each block's whole prefix: a lookup returns blocks whose full prefix
    equals the prompt's, block for block."""
    # a pool as large as every prompt's blocks together (a fresh block per full block registered; 64 once, and six
    # prompts of 12 tokens at block size 1 asked for 72)
    cache, contents, next_block = PrefixCache(sum(map(len, prompts)), block_size, True), {}, 0
    for prompt in prompts:
        hits = cache.lookup(prompt)
        for index, block in enumerate(hits):
            assert contents[block] == tuple(prompt[:(index + 1) * block_size])
        assert len(hits) * block_size < len(prompt)
        table = list(range(next_block, next_block + len(prompt) // block_size))
        next_block += len(table)
        parent = ROOT_CONTENT_ID
        for index, block in enumerate(table):
            parent = cache.register(parent, block, prompt[index * block_size:(index + 1) * block_size])
            if cache.is_cached(block):
                contents[block] = tuple(prompt[:(index + 1) * block_size])
    cache.check()
