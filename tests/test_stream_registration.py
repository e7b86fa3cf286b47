"""A request of one sample registers its stream's blocks only when it is preempted; when it finishes, its stream's
blocks are freed as the cached blocks that registering them at admission would have made (to the free queue's tail),
with no cache entries. Driven side by side, a pool that registers every stream at admission and one that leaves it
for later must queue the same blocks in the same order, cache the same ones and hit the same ones, whatever the
operations; without ending the stream at release, the orders part (the test can fail)."""
import random

import pytest

from lab.kv_cache.block_manager import KVBlockManager, OutOfBlocksError

BLOCK_SIZE = 4


def _state(manager: KVBlockManager) -> tuple:
    """The free queue in order, which of its blocks are cached, and the hits so far (a live sequence's blocks are
    cached in one pool and not yet in the other: that is the point)."""
    free = manager.free_block_queue.queued()
    return free, [manager.is_cached(block) for block in free], manager.prefix_cache_stats.hit_blocks


def _drive(seed: int, end_stream: bool = True) -> list[tuple]:
    """Random admissions, decode appends, preemptions (register, release, later re-admission with hits) and
    finishes on an eager pool and a deferring one; the states of both after every operation."""
    rng = random.Random(seed)
    eager, deferring = (KVBlockManager(48, BLOCK_SIZE, enable_prefix_caching=True) for _ in range(2))
    running, preempted, next_id, states = {}, {}, 0, []
    for _ in range(300):
        action = rng.random()
        if action < 0.35 or not running:
            if preempted and rng.random() < 0.5:
                seq, tokens = preempted.popitem()  # re-admitted: its stream is cached, so both register now
                stream = ("stream", seq)
            else:
                seq, tokens, stream = next_id, rng.randint(1, 30), ("stream", next_id)
                next_id += 1
            register = eager.prefix_cache.has_stream(stream)
            try:
                eager.create_sequence(seq, num_prompt_tokens=tokens, stream_key=stream)
            except OutOfBlocksError:
                with pytest.raises(OutOfBlocksError):
                    deferring.create_sequence(seq, num_prompt_tokens=tokens, stream_key=stream,
                                              register_stream=register)
                continue
            deferring.create_sequence(seq, num_prompt_tokens=tokens, stream_key=stream, register_stream=register)
            running[seq] = tokens
        elif action < 0.75:
            seq = rng.choice(list(running))
            count = rng.randint(1, 6)
            if eager.num_blocks_to_append(seq, count) <= eager.num_free_blocks:
                for manager in (eager, deferring):
                    manager.append_tokens(seq, count)
                running[seq] += count
        elif action < 0.85:  # preempted (recompute): its full blocks stay findable
            seq = rng.choice(list(running))
            for manager in (eager, deferring):
                manager.register_blocks(seq, sampled=True)
                manager.release_sequence(seq, 0, end_stream)
            preempted[seq] = running.pop(seq)
        else:  # finished
            seq = rng.choice(list(running))
            eager.release_sequence(seq)
            deferring.release_sequence(seq, 0, end_stream)
            running.pop(seq)
        for manager in (eager, deferring):
            manager.check_invariants()
        states.append((_state(eager), _state(deferring)))
    return states


@pytest.mark.parametrize("seed", range(12))
def test_a_deferred_stream_queues_caches_and_hits_as_an_eager_one(seed):
    for step, (eager, deferring) in enumerate(_drive(seed)):
        assert deferring == eager, f"seed {seed}, operation {step}"


def test_without_ending_the_stream_the_free_queue_order_parts():
    assert any(eager != deferring for seed in range(12) for eager, deferring in _drive(seed, end_stream=False))
