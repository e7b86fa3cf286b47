"""``simulator.views.pool_frames``: the block-pool page's frames from the simulator and from the engine, without Streamlit."""
import pytest

from simulator.views.pool_frames import PoolRunConfig, busiest_frame, record_pool_frames


@pytest.mark.parametrize("source", ["simulator", "engine"])
def test_frames_come_every_k_steps_and_show_sharing_and_the_pool_size(source):
    seen = []
    config = PoolRunConfig(source=source, num_blocks=48, block_size=4, num_requests=10, n=2,
                           shared_prefix_tokens=8, frame_every=3)
    frames = record_pool_frames(config, seen.append)
    assert seen == frames and len(frames) > 2
    steps = [step for step, _ in frames]
    assert all(step % 3 == 0 for step in steps) and steps == sorted(steps)
    assert all(len(pool.ref_counts) == 48 and pool.block_size == 4 and pool.host_pool is None for _, pool in frames)
    assert any(count > 1 for _, pool in frames for count in pool.ref_counts)  # samples and the prefix share blocks
    busiest = busiest_frame(frames)
    in_use = [48 - pool.num_free_blocks for _, pool in frames]
    assert in_use[busiest] == max(in_use) and busiest == in_use.index(max(in_use))


@pytest.mark.parametrize("source", ["simulator", "engine"])
def test_swapping_shows_the_host_pool(source):
    frames = record_pool_frames(PoolRunConfig(source=source, num_blocks=16, num_requests=40, n=1,
                                              preemption_mode="swap", frame_every=1))
    assert all(pool.host_pool is not None for _, pool in frames)
    assert any(pool.host_pool.num_free_blocks < len(pool.host_pool.ref_counts) for _, pool in frames)


def test_bad_source_and_runs_shorter_than_a_frame_are_errors():
    with pytest.raises(ValueError, match="source='gpu'"):
        record_pool_frames(PoolRunConfig(source="gpu"))
    with pytest.raises(ValueError, match="before the first frame"):
        record_pool_frames(PoolRunConfig(source="engine", num_requests=1, frame_every=10_000))
