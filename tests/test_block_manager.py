"""Unit and state-machine tests of lab.kv_cache.block_manager.KVBlockManager."""
from array import array
from unittest import mock

import pytest
from hypothesis import example, given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from lab.kv_cache.pool_view import block_owners
from tests.pool_checks import invariants_ok
from lab.kv_cache.block_manager import (BLOCK_ID, DuplicateSequenceError, KVBlockManager, OutOfBlocksError, UnknownSequenceError)


def snapshot(manager: KVBlockManager):
    return (list(manager.ref_counts), manager.num_free_blocks, {k: (list(v.block_table), v.num_tokens)
                                                               for k, v in manager.sequences.items()},
            list(manager.pending_copies), manager.num_cached_blocks)


def test_append_takes_a_block_only_at_boundaries():
    m = KVBlockManager(8, 4)
    m.create_sequence("a")
    slots = [m.append_token("a") for _ in range(9)]
    table = m.get_block_table("a")
    assert len(table) == 3 and m.num_free_blocks == 5
    assert slots == [table[i // 4] * 4 + i % 4 for i in range(9)]
    assert m.get_slot_mapping("a", 0, 9) == slots
    m.check_invariants()


def test_create_with_prompt_allocates_ceil_blocks():
    m = KVBlockManager(10, 3)
    assert m.create_sequence("a", num_prompt_tokens=7) == 0
    assert len(m.get_block_table("a")) == 3 and m.get_sequence_length("a") == 7
    assert m.can_allocate(num_prompt_tokens=21) and not m.can_allocate(num_prompt_tokens=22)


def test_fork_shares_blocks_and_cow_copies_partial_last_block():
    m = KVBlockManager(8, 4)
    m.create_sequence("p", num_prompt_tokens=6)  # one full block + one partial
    m.fork_sequence("p", "c")
    assert m.get_block_table("p") == m.get_block_table("c")
    full, partial = m.get_block_table("p")
    assert m.ref_counts[full] == 2 and m.ref_counts[partial] == 2 and m.num_free_blocks == 6
    slot = m.append_token("c")
    new = m.get_block_table("c")[1]
    assert new != partial and slot == new * 4 + 2
    pending = m.pending_copies  # the policy keeps this list to see copies without a call: it must stay the same
    copies = m.take_pending_copies()
    assert copies == [(partial, new)] and m.take_pending_copies() == [] and m.pending_copies is pending
    assert copies is not pending  # the caller owns what it took
    assert m.get_block_table("c")[0] == full and m.ref_counts[full] == 2
    m.append_token("p")  # parent's block is no longer shared: written in place, no copy
    assert m.get_block_table("p")[1] == partial and m.pending_copies == []
    m.check_invariants()
    assert invariants_ok(m)
    m._ref_counts[full] += 1  # corrupt the stored count: the check must notice
    assert not invariants_ok(m)


def test_exclusive_sequences_hold_implicit_counts_until_shared():
    """An exclusive sequence's blocks are stored with count 0 (no per-block writes); ``ref_counts`` still says 1,
    forking or registering a stream stores them, and a stray stored count is caught."""
    m = KVBlockManager(16, 4, enable_prefix_caching=True)
    m.create_sequence("a", num_prompt_tokens=9)
    m.create_sequence("s", num_prompt_tokens=8, stream_key="s", register_stream=False)
    m.reserve_blocks(2)
    a, s = m.get_block_table("a"), m.get_block_table("s")
    assert m._ref_counts == [0] * 16
    assert [m.ref_counts[b] for b in a + s + m.reserved_blocks] == [1] * 7 and m.ref_counts.count(0) == 9
    assert not any(m.is_shared(b) for b in a)
    m.check_invariants()
    m.fork_sequence("a", "b")
    assert [m._ref_counts[b] for b in a] == [2, 2, 2] and m.is_shared(a[-1])
    m.register_blocks("s")
    assert [m._ref_counts[b] for b in s] == [1, 1]
    m.append_tokens("s", 1, from_reserved=True)  # a non-exclusive holder stores its new block's count
    assert m._ref_counts[m.get_block_table("s")[-1]] == 1
    m.check_invariants()
    m.create_sequence("c", num_prompt_tokens=4)
    m._ref_counts[m.get_block_table("c")[0]] = 1  # a stored count on an exclusive block: the check must notice
    assert not invariants_ok(m)


def test_fork_at_block_boundary_needs_no_copy():
    m = KVBlockManager(8, 4)
    m.create_sequence("p", num_prompt_tokens=4)
    m.fork_sequence("p", "c")
    m.append_token("c")
    assert m.pending_copies == [] and m.num_cow_copies == 0


def test_release_frees_only_at_zero_refs():
    m = KVBlockManager(4, 2)
    m.create_sequence("p", num_prompt_tokens=4)
    m.fork_sequence("p", "c")
    m.release_sequence("p")
    assert m.num_free_blocks == 2
    m.release_sequence("c")
    assert m.num_free_blocks == 4
    with pytest.raises(UnknownSequenceError):
        m.release_sequence("c")


def test_out_of_blocks_leaves_manager_unchanged():
    m = KVBlockManager(3, 2)
    m.create_sequence("a", num_prompt_tokens=4)
    m.fork_sequence("a", "b")
    m.create_sequence("c", num_prompt_tokens=1)
    before = snapshot(m)
    with pytest.raises(OutOfBlocksError):
        m.create_sequence("d", num_prompt_tokens=3)
    with pytest.raises(OutOfBlocksError):
        m.append_tokens("a", 3)
    m.append_token("c")
    before = snapshot(m)
    with pytest.raises(OutOfBlocksError):
        m.append_token("c")
    assert snapshot(m) == before and "d" not in m.sequences
    assert m.num_blocks_to_append("c") == 1 > m.num_free_blocks


def test_out_of_blocks_on_cow_leaves_manager_unchanged():
    m = KVBlockManager(1, 4)
    m.create_sequence("a", num_prompt_tokens=2)
    m.fork_sequence("a", "b")
    before = snapshot(m)
    with pytest.raises(OutOfBlocksError):
        m.append_token("b")
    assert snapshot(m) == before


def test_duplicate_and_bad_arguments():
    m = KVBlockManager(4, 2)
    m.create_sequence("a")
    with pytest.raises(DuplicateSequenceError):
        m.create_sequence("a")
    m.create_sequence("b")
    with pytest.raises(DuplicateSequenceError):
        m.fork_sequence("a", "b")
    with pytest.raises(UnknownSequenceError):
        m.append_token("zzz")
    with pytest.raises(ValueError, match="block_size"):
        KVBlockManager(4, 0)
    with pytest.raises(ValueError, match="num_physical_blocks"):
        KVBlockManager(0, 4)
    with pytest.raises(ValueError, match="num_prompt_tokens"):
        m.create_sequence("c", prompt_token_ids=[1, 2], num_prompt_tokens=3)
    with pytest.raises(ValueError, match="positions"):
        m.get_slot_mapping("a", 0, 5)


def test_prefix_cache_hits_reuse_blocks_and_count():
    m = KVBlockManager(16, 4, enable_prefix_caching=True)
    prompt = list(range(10))
    assert m.create_sequence("a", prompt) == 0
    hit = m.create_sequence("b", prompt[:8] + [99, 98, 97])
    assert hit == 8
    assert m.get_block_table("a")[:2] == m.get_block_table("b")[:2]
    assert m.get_block_table("a")[2] != m.get_block_table("b")[2]
    assert m.prefix_cache_stats.hit_blocks == 2 and m.prefix_cache_stats.hit_tokens == 8
    m.check_invariants()


def test_prefix_cache_always_leaves_last_token_to_compute():
    m = KVBlockManager(16, 4, enable_prefix_caching=True)
    m.create_sequence("a", list(range(8)))
    assert m.create_sequence("b", list(range(8))) == 4  # the second block holds the last token: recomputed


def test_prefix_cache_survives_release_and_evicts_lru():
    m = KVBlockManager(4, 2, enable_prefix_caching=True)
    m.create_sequence("a", [1, 2, 3, 4, 5])
    a_table = m.get_block_table("a")
    m.release_sequence("a")
    assert m.num_free_blocks == 4 and m.num_cached_blocks == 2
    assert m.create_sequence("b", [1, 2, 3, 4, 6]) == 4 and m.get_block_table("b")[:2] == a_table[:2]
    m.release_sequence("b")
    m.create_sequence("c", num_prompt_tokens=7)  # needs all 4 blocks: evicts every cached block
    assert m.num_cached_blocks == 0
    m.release_sequence("c")
    assert m.create_sequence("d", [1, 2, 3, 4, 5]) == 0
    m.check_invariants()


def test_prefix_cache_never_returns_a_block_with_other_tokens(monkeypatch):
    m = KVBlockManager(16, 2, enable_prefix_caching=True)
    m.create_sequence("a", [1, 2, 3, 4, 9])
    assert m.create_sequence("b", [1, 2, 4, 3, 9]) == 2  # same first block, different second block
    assert m.create_sequence("c", [2, 1, 3, 4, 9]) == 0  # same second block tokens, different prefix
    assert m.get_block_table("c")[1] != m.get_block_table("a")[1]


def test_prefix_cache_correct_under_forced_hash_collisions():
    class CollidingKey(tuple):
        def __hash__(self):
            return 7  # every block key lands in the same hash bucket

    class CollidingManager(KVBlockManager):
        @staticmethod
        def _block_key(parent_content_id, token_ids):
            return CollidingKey((parent_content_id, tuple(token_ids)))

    m = CollidingManager(16, 2, enable_prefix_caching=True)
    m.create_sequence("a", [1, 2, 3, 4, 9])
    assert m.create_sequence("b", [2, 1, 3, 4, 9]) == 0
    assert m.create_sequence("c", [1, 2, 4, 3, 9]) == 2
    assert m.create_sequence("d", [1, 2, 3, 4, 8]) == 4 and m.get_block_table("d")[:2] == m.get_block_table("a")[:2]


def test_batch_exports():
    m = KVBlockManager(16, 4)
    m.create_sequence(0, num_prompt_tokens=9)
    m.create_sequence(1, num_prompt_tokens=2)
    assert len(m.get_block_table(0)) == 3 and len(m.get_block_table(1)) == 1
    assert [m.get_sequence_length(s) for s in (1, 0)] == [2, 9]
    owners = block_owners(m)
    assert sum(len(o) for o in owners) == 4
    table = m.get_block_table(0)
    assert m.get_slot_mapping(0, 7, 9) == [table[1] * 4 + 3, table[2] * 4]
    assert m.get_decode_slots([0, 1], [8, 1]) == m.get_slot_mapping(0, 8, 9) + m.get_slot_mapping(1, 1, 2)


def test_append_tokens_equals_repeated_append_token():
    a, b = KVBlockManager(32, 3), KVBlockManager(32, 3)
    for m in (a, b):
        m.create_sequence("s", num_prompt_tokens=2)
        m.fork_sequence("s", "t")
    for _ in range(11):
        a.append_token("t")
    b.append_tokens("t", 11)
    assert snapshot(a) == snapshot(b)


class BlockManagerMachine(RuleBasedStateMachine):
    """Random create/append/fork/release against a model of the KV contents: each slot of a fake cache holds the
    token written there, copy-on-write copies are executed, and every sequence must read back its own tokens."""

    def __init__(self):
        super().__init__()
        self.next_id = 0

    @initialize(num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 2, 3, 4]), caching=st.booleans())
    def setup(self, num_blocks, block_size, caching):
        self.m = KVBlockManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.store = [None] * (num_blocks * block_size)
        self.tokens = {}

    def _execute_copies(self):
        size = self.m.block_size
        for src, dst in self.m.take_pending_copies():
            self.store[dst * size:(dst + 1) * size] = self.store[src * size:(src + 1) * size]

    @rule(prompt=st.lists(st.integers(0, 2), max_size=10))
    def create(self, prompt):
        seq = self.next_id
        self.next_id += 1
        if not self.m.can_allocate(prompt):
            before = snapshot(self.m)
            with pytest.raises(OutOfBlocksError):
                self.m.create_sequence(seq, prompt)
            assert snapshot(self.m) == before
            return
        cached = self.m.create_sequence(seq, prompt)
        assert cached < max(len(prompt), 1) and cached % self.m.block_size == 0
        slots = self.m.get_slot_mapping(seq, 0, len(prompt))
        assert [self.store[s] for s in slots[:cached]] == prompt[:cached]
        for slot, token in zip(slots[cached:], prompt[cached:]):
            self.store[slot] = token
        self.tokens[seq] = list(prompt)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), token=st.integers(0, 2))
    def append(self, data, token):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        table, length, size = self.m.get_block_table(seq), len(self.tokens[seq]), self.m.block_size
        expect_cow = length % size != 0 and self.m.ref_counts[table[-1]] > 1
        if not (self.m.num_blocks_to_append(seq) <= self.m.num_free_blocks):
            before = snapshot(self.m)
            with pytest.raises(OutOfBlocksError):
                self.m.append_token(seq, token)
            assert snapshot(self.m) == before
            return
        slot = self.m.append_token(seq, token)
        assert (len(self.m.pending_copies) == 1) == expect_cow
        self._execute_copies()
        self.store[slot] = token
        self.tokens[seq].append(token)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), tokens=st.lists(st.integers(0, 2), min_size=1, max_size=9))
    def append_many(self, data, tokens):
        """``append_tokens`` with their ids: its blocks come in one pop, then the full ones are hashed."""
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        length = len(self.tokens[seq])
        if not (self.m.num_blocks_to_append(seq, len(tokens)) <= self.m.num_free_blocks):
            before = snapshot(self.m)
            with pytest.raises(OutOfBlocksError):
                self.m.append_tokens(seq, len(tokens), tokens)
            assert snapshot(self.m) == before
            return
        self.m.append_tokens(seq, len(tokens), tokens)
        self._execute_copies()
        for slot, token in zip(self.m.get_slot_mapping(seq, length, length + len(tokens)), tokens):
            self.store[slot] = token
        self.tokens[seq].extend(tokens)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child = self.next_id
        self.next_id += 1
        free = self.m.num_free_blocks
        self.m.fork_sequence(parent, child)
        assert self.m.num_free_blocks == free and not self.m.pending_copies
        self.tokens[child] = list(self.tokens[parent])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def release(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.m.release_sequence(seq)
        del self.tokens[seq]

    @invariant()
    def pool_is_consistent(self):
        if not hasattr(self, "m"):
            return
        self.m.check_invariants()
        owner_of_slot = {}
        for seq, tokens in self.tokens.items():
            assert self.m.get_sequence_length(seq) == len(tokens)
            slots = self.m.get_slot_mapping(seq, 0, len(tokens))
            assert [self.store[s] for s in slots] == tokens, f"sequence {seq} reads back other tokens"
            for pos, slot in enumerate(slots):
                other = owner_of_slot.setdefault(slot, (seq, pos))
                if other[0] != seq:  # two sequences share a slot only through a shared block, same position
                    assert other[1] == pos and self.m.ref_counts[slot // self.m.block_size] > 1

    def teardown(self):
        if hasattr(self, "m"):
            for seq in list(self.tokens):
                self.m.release_sequence(seq)
            assert self.m.num_free_blocks == self.m.num_physical_blocks, "blocks leaked"
            self.m.check_invariants()


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_move_sequences_keeps_sharing_and_changes_nothing_on_error():
    gpu, cpu = KVBlockManager(12, 4, enable_prefix_caching=True), KVBlockManager(5, 4)
    gpu.create_sequence("a", list(range(10)))  # 3 blocks, the last partial
    gpu.fork_sequence("a", "b")
    gpu.create_sequence("c", num_prompt_tokens=9)
    mapping = gpu.move_sequences(["a", "b"], cpu)
    assert len(mapping) == 3 and cpu.get_block_table("a") == cpu.get_block_table("b")
    assert [cpu.ref_counts[b] for b in cpu.get_block_table("a")] == [2, 2, 2]
    assert "a" not in gpu.sequences and gpu.num_free_blocks == 12 - 3 and cpu.get_sequence_length("b") == 10
    assert gpu.num_cached_blocks == 2  # the full prompt blocks stay findable on the device
    before = (snapshot(gpu), snapshot(cpu))
    with pytest.raises(OutOfBlocksError):
        gpu.move_sequences(["c"], cpu)  # 3 blocks, 2 free in the host pool
    other = KVBlockManager(8, 4)
    other.create_sequence("c", num_prompt_tokens=1)
    with pytest.raises(DuplicateSequenceError):
        gpu.move_sequences(["c"], other)
    with pytest.raises(UnknownSequenceError):
        gpu.move_sequences(["zz"], other)
    assert (snapshot(gpu), snapshot(cpu)) == before
    back = cpu.move_sequences(["a", "b"], gpu)
    assert len(back) == 3 and gpu.get_block_table("a") == gpu.get_block_table("b")
    for manager in (gpu, cpu, other):
        manager.check_invariants()
    assert cpu.num_free_blocks == 5


def test_bad_token_ids_change_nothing():
    from lab.kv_cache.block_manager import InvalidTokenError

    m = KVBlockManager(8, 2, enable_prefix_caching=True)
    m.create_sequence("a", [1, 2, 3])
    before = snapshot(m)
    with pytest.raises(InvalidTokenError, match="token_id"):
        m.append_token("a", "x")
    with pytest.raises(InvalidTokenError, match="token_ids"):
        m.append_tokens("a", 2, [4, 2.5])
    with pytest.raises(InvalidTokenError, match="num_tokens"):
        m.append_tokens("a", 1.0)
    with pytest.raises(InvalidTokenError, match="prompt_token_ids"):
        m.create_sequence("b", [1, None])
    assert snapshot(m) == before and m.get_sequence_length("a") == 3
    m.append_token("a", 4)  # completes block [3, 4]: cached under its real tokens
    m.create_sequence("c", [1, 2, 3, 4, 9])
    assert m.get_block_table("c")[:2] == m.get_block_table("a")[:2]
    m.check_invariants()


def test_checked_token_ids_are_taken_as_lists_are():
    from lab.kv_cache.block_manager import InvalidTokenError, TokenIds

    with pytest.raises(InvalidTokenError, match="token_ids"):
        TokenIds([1, True])
    with pytest.raises(InvalidTokenError, match="token_ids"):
        TokenIds("12")
    prompt = [5, 6, 7, 8, 9, 10, 11]
    with_list, with_checked = KVBlockManager(8, 2, True), KVBlockManager(8, 2, True)
    for m, ids in ((with_list, list), (with_checked, TokenIds)):
        m.create_sequence("a", ids(prompt))
        assert m.can_allocate(ids(prompt + [1] * 5)) and not m.can_allocate(ids(prompt + [1] * 9))
        assert m.create_sequence("b", ids(prompt[:5] + [3, 3])) == 4  # two cached blocks
        m.append_tokens("b", 3, ids([4, 4, 4]))
        m.check_invariants()
    assert snapshot(with_list) == snapshot(with_checked)


def test_a_key_registered_while_growing_survives_the_eviction_of_a_block_taken_with_it():
    """Appending [1, 2, 7, 7] takes free blocks 1 and then 0; block 0 still holds the key of [1, 2]. Taking them one at
    a time, the first found that key on block 0 (so did not register its own), then took and evicted block 0: [1, 2]
    was cached nowhere and a later prompt [1, 2, 7, 7, ...] hit nothing."""
    m = KVBlockManager(3, 2, enable_prefix_caching=True)
    m.create_sequence("a", [1, 2, 3])
    m.create_sequence("x", [8])
    m.release_sequence("a")
    assert list(m.free_block_queue.queued()) == [1, 0]
    m.create_sequence("c", [])
    m.append_tokens("c", 4, [1, 2, 7, 7])
    m.check_invariants()
    m.release_sequence("c")
    m.release_sequence("x")
    assert m.create_sequence("d", [1, 2, 7, 7, 5]) == 4
    m.check_invariants()


def test_reserved_blocks_evict_and_hand_out_as_eager_appends_would():
    """Reserving is O(1) (the blocks leave the free queue lazily) but every later view and operation sees the same
    evictions as appending those blocks one by one at once would have caused."""
    prompts = [[100 * p + t for t in range(12)] for p in range(3)]

    def warm(m):
        for i, prompt in enumerate(prompts):  # 3 cached full blocks each, then free (LRU: prompt 0 oldest)
            m.create_sequence(i, prompt)
            m.release_sequence(i)
        m.create_sequence("r", [7] * 4)

    lazy, eager = KVBlockManager(10, 4, True), KVBlockManager(10, 4, True)
    warm(lazy), warm(eager)
    lazy.reserve_blocks(4)
    eager.append_tokens("r", 16)  # 4 new blocks from the head of the free queue
    assert lazy.num_free_blocks == eager.num_free_blocks == 5
    for prompt in prompts:
        assert lazy.can_allocate(prompt, extra_blocks=5) == eager.can_allocate(prompt, extra_blocks=5)
    assert lazy.create_sequence("x", prompts[1]) == eager.create_sequence("x", prompts[1]) == 8
    lazy.append_tokens("r", 16, from_reserved=True)
    assert sorted(lazy.get_block_table("r")) == sorted(eager.get_block_table("r"))
    assert lazy.ref_counts == eager.ref_counts and not lazy.reserved_blocks
    lazy.check_invariants()


def test_reservations_are_checked_and_released_with_a_sequence():
    m = KVBlockManager(6, 4)
    m.create_sequence("a", num_prompt_tokens=4)
    with pytest.raises(OutOfBlocksError):
        m.reserve_blocks(6)
    m.reserve_blocks(2)
    assert m.num_free_blocks == 3 and len(m.reserved_blocks) == 2
    with pytest.raises(OutOfBlocksError):
        m.append_tokens("a", 9, from_reserved=True)  # needs 3 reserved blocks
    with pytest.raises(OutOfBlocksError):
        m.release_sequence("a", 3)
    assert m.get_sequence_length("a") == 4 and len(m.reserved_blocks) == 2
    m.append_tokens("a", 4, from_reserved=True)
    m.check_invariants()
    m.release_sequence("a", 1)  # with the reserved block it never took
    assert m.num_free_blocks == 6 and not m.reserved_blocks and not m.sequences
    # the scheduler's per-step call: no argument check, the same effect; a release checks the reservations still
    # pending (not yet taken off the free queue) before it changes anything
    assert m.try_reserve_counted_blocks(0) and m.try_reserve_counted_blocks(3) and not m.try_reserve_counted_blocks(4)
    m.create_sequence("b", num_prompt_tokens=4)
    with pytest.raises(OutOfBlocksError):
        m.release_sequence("b", 4)
    assert m.num_free_blocks == 2 and m.get_sequence_length("b") == 4
    m.release_sequence("b", 3)
    assert m.num_free_blocks == 6 and not m.reserved_blocks and not m.sequences
    m.check_invariants()


def test_invariants_catch_a_block_cached_under_other_tokens():
    """The bug class of a half-applied append: a block whose cache key names tokens it does not hold would hand a
    wrong prefix to a later prompt. ``invariants_ok`` compares every cached block's key with its tokens."""
    m = KVBlockManager(8, 2, enable_prefix_caching=True)
    m.create_sequence("a", [1, 2, 3, 4, 5])
    m.append_token("a", 6)
    assert invariants_ok(m)
    first, second = m.get_block_table("a")[:2]
    cache = m.prefix_cache
    key_first, key_second = cache.block_keys[first], cache.block_keys[second]
    wrong = (key_second[0], (9, 9))  # block 2 claims tokens (9, 9)
    del cache.blocks[key_second]
    cache.blocks[wrong], cache.block_keys[second] = second, wrong
    with pytest.raises(AssertionError, match="cached under other tokens"):
        m.check_invariants()
    assert not invariants_ok(m) and key_first is not None


def test_free_blocks_are_reused_as_vllm_0_32_orders_them():
    """Uncached freed blocks are reused first (the last freed first), cached ones evicted least recently freed first
    (``BlockPool.free_blocks``, vllm/v1/core/block_pool.py); a request's blocks are freed tail first."""
    m = KVBlockManager(8, 2, enable_prefix_caching=True)
    m.create_sequence("cached", [1, 2, 3, 4, 5])  # blocks of [1, 2] and [3, 4] cached, [5] not
    m.create_sequence("plain", num_prompt_tokens=4)
    cached, plain = m.get_block_table("cached"), m.get_block_table("plain")
    m.release_sequence("cached")
    m.release_sequence("plain")
    queued = m.free_block_queue.queued()
    assert queued[:3] == [plain[1], plain[0], cached[2]]  # uncached: the last freed at the head, each tail first
    assert queued[-2:] == [cached[1], cached[0]]  # cached: at the end, tail first
    m.create_sequence("next", num_prompt_tokens=6)
    assert list(m.get_block_table("next")) == queued[:3]  # the cached blocks survive
    assert m.create_sequence("again", [1, 2, 3, 4, 9]) == 4
    m.check_invariants()


def test_many_uncached_releases_before_the_head_keep_the_queue_whole():
    m = KVBlockManager(300, 1)
    for i in range(300):
        m.create_sequence(i, num_prompt_tokens=1)
    for i in range(300):
        m.release_sequence(i)  # each prepends past a head that has no room: the queue pads its front
    assert m.free_block_queue.queued() == list(range(299, -1, -1)) and m.num_free_blocks == 300
    m.check_invariants()


def test_a_first_chunk_takes_the_hits_and_its_own_blocks_only():
    m = KVBlockManager(16, 4, enable_prefix_caching=True)
    m.create_sequence("a", list(range(12)))
    assert m.create_sequence("b", list(range(8)) + [50, 51, 52, 53, 54, 55], max_new_tokens=3) == 8
    assert m.get_sequence_length("b") == 11 and len(m.get_block_table("b")) == 3
    m.append_tokens("b", 3, [53, 54, 55])
    assert len(m.get_block_table("b")) == 4
    m.check_invariants()


def test_sampled_blocks_registered_at_preemption_are_hit_again():
    """Tokens appended without ids stop the hashing; ``register_blocks`` with the tokens caches those blocks too,
    so the sequence prefilled again (prompt and what it sampled) hits them."""
    m = KVBlockManager(16, 4, enable_prefix_caching=True)
    tokens = list(range(100, 114))
    m.create_sequence("a", tokens[:6])
    m.append_tokens("a", 7)  # decoded: ids unknown to the manager
    m.register_blocks("a", tokens[:13])
    m.release_sequence("a")
    assert m.create_sequence("a again", tokens) == 12  # three full blocks of prompt and sampled tokens
    m.check_invariants()


@pytest.mark.parametrize("seed", range(20))
def test_a_new_stream_s_one_call_admission_and_release_are_the_three_calls(seed):
    """``create_unseen_stream`` and ``release_ending_stream`` (the simulator's per-request calls) leave the pool as
    ``create_sequence(register_stream=False)`` and ``append_tokens(from_reserved)`` + ``register_blocks(ending)`` +
    ``release_sequence(end_stream)`` do: the same free queue, block for block, and the same statistics."""
    import random

    rng = random.Random(seed)
    size = rng.choice([1, 3, 7, 16])
    pools = [KVBlockManager(64, size, enable_prefix_caching=True) for _ in range(2)]
    live: dict[int, int] = {}
    for step in range(60):
        if live and (rng.random() < 0.5 or len(live) > 4):
            seq_id = rng.choice(sorted(live))
            grown = live.pop(seq_id) + rng.randint(0, 3 * size)
            owed = -(-grown // size) - len(pools[0].sequences[seq_id].block_table)
            if owed > pools[0].num_free_blocks:
                grown, owed = pools[0].sequences[seq_id].num_tokens, 0
            for pool in pools:
                pool.reserve_blocks(owed)
            fast, slow = pools
            assert fast.release_ending_stream(seq_id, grown)
            slow.append_tokens(seq_id, grown - slow.sequences[seq_id].num_tokens, from_reserved=True)
            slow.register_blocks(seq_id, sampled=True, ending=True)
            slow.release_sequence(seq_id, end_stream=True)
        else:
            tokens = rng.randint(0, 5 * size)
            if -(-tokens // size) > pools[0].num_free_blocks:
                continue
            pools[0].create_unseen_stream(step, tokens, ("stream", step))
            pools[1].create_sequence(step, num_prompt_tokens=tokens, stream_key=("stream", step),
                                     register_stream=False)
            live[step] = tokens
        assert pools[0].free_block_queue.queued() == pools[1].free_block_queue.queued(), step
        assert pools[0].free_block_queue.ended_blocks() == pools[1].free_block_queue.ended_blocks()
        assert snapshot(pools[0]) == snapshot(pools[1])
        assert pools[0].prefix_cache_stats == pools[1].prefix_cache_stats
        for pool in pools:
            pool.check_invariants()


def test_the_one_call_release_declines_what_it_does_not_cover():
    m = KVBlockManager(16, 4, enable_prefix_caching=True)
    m.create_sequence("registered", num_prompt_tokens=8, stream_key="r")  # registered now: not deferred
    m.create_unseen_stream("deferred", 8, "d")
    assert not m.release_ending_stream("registered", 8) and "registered" in m.sequences
    assert not m.release_ending_stream("deferred", 12) and m.sequences["deferred"].num_tokens == 8  # nothing reserved
    assert not m.release_ending_stream("deferred", 4)  # fewer tokens than it holds
    assert m.release_ending_stream("deferred", 8) and "deferred" not in m.sequences
    with pytest.raises(DuplicateSequenceError):
        m.create_unseen_stream("registered", 4, "x")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["pop", "pop_one", "prepend", "push_ended", "push_ended_one", "push_keyed",
                                           "take"]), st.integers(1, 6)), max_size=60),
       st.sampled_from([(4096, 64), (1, 1), (3, 2)]))
@example([("pop", 6), ("pop", 2), ("push_keyed", 1), ("push_keyed", 1), ("push_keyed", 1), ("push_keyed", 1),
          ("take", 4), ("take", 1), ("pop", 2)], (4096, 64))  # an allocation that meets a tombstone, then another past it
def test_the_free_queue_keeps_order_and_ended_blocks_through_any_interleaving(operations, thresholds):
    """``FreeBlockQueue`` against a list model: allocation takes the head without trimming the ended ranges (their
    queued part starts at the highest position the head has reached), so a prepend over a consumed part of an ended
    range must not make its blocks look ended, whatever the interleaving; a cached block taken back by a prefix hit
    leaves a tombstone that allocation skips (``take``). Tiny compaction and pruning thresholds (``thresholds``) make
    the queue drop its consumed entries and ended ranges all the time: nothing it shows may change."""
    from lab.kv_cache import block_manager

    with mock.patch.multiple(block_manager, COMPACT_MIN=thresholds[0], ENDED_PRUNE_MIN=thresholds[1]):
        _free_queue_against_a_model(block_manager.FreeBlockQueue, operations)


def _free_queue_against_a_model(FreeBlockQueue, operations):
    num_blocks = 8
    keys = [None] * num_blocks
    queue = FreeBlockQueue(num_blocks, keys)
    model = [(block, False) for block in range(num_blocks)]  # (block, ended), head first
    out = []  # blocks taken, to be queued again
    for name, count in operations:
        if name.startswith("pop"):
            count = 1 if name == "pop_one" else min(count, len(model))
            if not model:
                continue
            taken = [queue.pop_one()] if name == "pop_one" else list(queue.pop(count))
            assert taken == [block for block, _ in model[:count]]
            for block in taken:  # reused: its cache entry goes (the manager's eviction)
                if keys[block] is not None:
                    keys[block] = None
                    queue.num_keyed -= 1
            del model[:count]
            out += taken
            continue
        if name == "take":  # a hit on the count-th keyed block queued (if any)
            cached = [block for block, _ in model if keys[block] is not None]
            if cached:
                block = cached[count % len(cached)]
                queue.take(block)
                model.remove((block, False))
                keys[block] = None
                out.append(block)
            continue
        count = 1 if name in ("push_ended_one", "push_keyed") else count
        blocks, out = out[:count], out[count:]
        if not blocks:
            continue
        if name == "prepend":
            queue.prepend_unkeyed(array(BLOCK_ID, blocks))
            model[:0] = [(block, False) for block in blocks]
        elif name == "push_keyed":
            keys[blocks[0]] = ("key", blocks[0])
            queue.push(blocks[0])
            model.append((blocks[0], False))
        elif name == "push_ended":
            queue.push_ended(array(BLOCK_ID, blocks))
            model += [(block, True) for block in blocks]
        else:
            queue.push_ended_one(blocks[0])
            model.append((blocks[0], True))
        assert queue.ended_blocks() == {block for block, ended in model if ended}
    assert queue.queued() == [block for block, _ in model] and len(queue) == len(model)
    assert queue.ended_blocks() == {block for block, ended in model if ended}
