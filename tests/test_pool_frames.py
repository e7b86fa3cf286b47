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


def test_pool_events_name_forks_copy_on_write_and_evictions():
    """``pool_events`` reads what happened between two snapshots of one pool from their block tables."""
    from lab.kv_cache.block_manager import KVBlockManager
    from lab.kv_cache.pool_view import pool_events, pool_occupancy, pool_snapshot

    manager = KVBlockManager(4, 4, enable_prefix_caching=True)
    manager.create_sequence("a", prompt_token_ids=list(range(6)))  # blocks: one full (cached), one half full
    start = pool_snapshot(manager)
    manager.fork_sequence("a", "b")
    forked = pool_snapshot(manager)
    assert sorted((e.kind, e.block, e.seq_id) for e in pool_events(start, forked)) == [
        ("shared", block, "b") for block in sorted(forked.block_tables["b"])]
    manager.append_token("b", 99)  # b writes into the shared half-full block: its own copy
    written = pool_snapshot(manager)
    cow = pool_events(forked, written)
    assert [(e.kind, e.seq_id) for e in cow] == [("copy-on-write", "b")]
    assert cow[0].block == written.block_tables["b"][1] != forked.block_tables["b"][1]
    for seq in ("a", "b"):
        manager.release_sequence(seq)
    released = pool_snapshot(manager)
    assert pool_events(written, released) == [] and released.cached[start.block_tables["a"][0]]
    manager.create_sequence("c", prompt_token_ids=list(range(100, 116)))  # 4 new full blocks: the cached one goes
    evicted = pool_events(released, pool_snapshot(manager))
    assert ("evicted", start.block_tables["a"][0]) in [(e.kind, e.block) for e in evicted]
    occupancy = pool_occupancy([(0, start), (1, forked), (2, written), (3, released)])
    assert [row["blocks_in_use"] for row in occupancy] == [2, 2, 3, 0]
    assert [row["shared_blocks"] for row in occupancy] == [0, 2, 1, 0]
    assert occupancy[3]["cached_free_blocks"] >= 1 and {row["num_blocks"] for row in occupancy} == {4}


def test_the_pool_picture_tells_sequences_apart_shows_free_blocks_and_highlights():
    from lab.kv_cache.pool_view import PoolEvent
    from lab.report.charts import FREE_COLOUR, block_pool_figure, sequence_colour

    # neighbouring sequence ids get different colours, and a sequence keeps its colour
    assert len({sequence_colour(i) for i in range(20)}) == 20 and sequence_colour(3) == sequence_colour(3)
    ref_counts, owners = [1, 1, 2, 0, 0], [[0], [1], [0, 1], [], []]
    figure = block_pool_figure(ref_counts, owners, columns=4, highlight=1,
                               events=[PoolEvent("copy-on-write", 1, 1), PoolEvent("evicted", 4)])
    heat = figure.data[0]
    z = heat.z.ravel()
    assert z[3] == z[4] == 0 and z[5] != z[5]  # free blocks drawn (colour 0), the cell past the pool's end empty
    scale = {round(point, 6): colour for point, colour in heat.colorscale}
    assert z[0] != z[1] and z[1] != z[2]  # sequence 0's block faded (not highlighted); 1's and the shared one not
    names = [trace.name for trace in figure.data[1:]]
    assert names[:3] == ["sequence 0", "sequence 1 (highlighted)", "free"]
    assert "copy-on-write (1)" in names and "evicted (1)" in names
    legend = {trace.name: trace.marker.color for trace in figure.data[1:4]}
    assert legend["sequence 0"] != legend["sequence 1 (highlighted)"] and legend["free"] == FREE_COLOUR
    assert "sequence 0, sequence 1" in heat.hovertext.ravel()[2] and len(scale) > 2
