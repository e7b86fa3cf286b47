"""Junk fed to every KVBlockManager operation: a typed error and an unchanged manager, or a correct result."""

from hypothesis import given, settings, strategies as st

from lab.kv_cache.block_manager import BlockManagerError, KVBlockManager

JUNK = st.one_of(st.integers(-3, 40), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=2),
                 st.none(), st.booleans(), st.lists(st.integers(-2, 1100), max_size=6), st.just(10**30))
SEQ_IDS = st.one_of(st.sampled_from(["a", "b", "c"]), JUNK)


def state(m):
    return (m.reserved_blocks, list(m.ref_counts), m.num_free_blocks, {k: (list(v.block_table), v.num_tokens)
                                                     for k, v in m.sequences.items()},
            list(m.pending_copies), m.num_cached_blocks)


OPERATIONS = {
    "create_sequence": lambda m, d: m.create_sequence(d.draw(SEQ_IDS), d.draw(st.one_of(st.none(), JUNK)),
                                                      d.draw(st.one_of(st.none(), JUNK))),
    "append_token": lambda m, d: m.append_token(d.draw(SEQ_IDS), d.draw(JUNK)),
    "append_tokens": lambda m, d: m.append_tokens(d.draw(SEQ_IDS), d.draw(JUNK), d.draw(st.one_of(st.none(), JUNK)),
                                                  d.draw(st.booleans())),
    "reserve_blocks": lambda m, d: m.reserve_blocks(d.draw(JUNK)),
    "fork_sequence": lambda m, d: m.fork_sequence(d.draw(SEQ_IDS), d.draw(SEQ_IDS)),
    "release_sequence": lambda m, d: m.release_sequence(d.draw(SEQ_IDS), d.draw(st.one_of(st.just(0), JUNK))),
    "can_allocate": lambda m, d: m.can_allocate(d.draw(st.one_of(st.none(), JUNK)), d.draw(st.one_of(st.none(), JUNK))),
    "num_blocks_to_append": lambda m, d: m.num_blocks_to_append(d.draw(SEQ_IDS), d.draw(JUNK)),
    "get_slot_mapping": lambda m, d: m.get_slot_mapping(d.draw(SEQ_IDS), d.draw(JUNK), d.draw(JUNK)),
}


@settings(max_examples=150, deadline=None)
@given(data=st.data(), caching=st.booleans())
def test_junk_never_corrupts_the_block_manager(data, caching):
    m = KVBlockManager(12, 3, enable_prefix_caching=caching)
    m.create_sequence("a", [1, 2, 3, 4, 5])
    for _ in range(data.draw(st.integers(1, 12))):
        name = data.draw(st.sampled_from(sorted(OPERATIONS)))
        before = state(m)
        try:
            OPERATIONS[name](m, data)
        except (BlockManagerError, ValueError) as exc:
            assert str(exc)
            assert state(m) == before, name
        m.check_invariants()
    for seq_id in list(m.sequences):
        m.release_sequence(seq_id)
    m.create_sequence("z")
    m.release_sequence("z", len(m.reserved_blocks))
    assert m.num_free_blocks == 12 and not m.reserved_blocks
