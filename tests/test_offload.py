"""The prefix cache's host offload tier (``lab.kv_cache.offload``): LRU with pinned slots, the engine's tokens unchanged by
tier hits and its host round trip bit-identical, and the simulator's checks (an unbounded tier reaches the
never-evict bound exactly; a workload that shares nothing loads nothing)."""
import dataclasses
from pathlib import Path

import pytest
import torch

from lab.engine import LLMEngine, SamplingParams
from lab.errors import LabError
from lab.kv_cache.offload import OffloadTier
from simulator import SimConfig, closed_form_checks, compare, make_workload
from tests.test_shared_scheduler import make_prompts

MOONCAKE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_fast25" / "conversation_trace.jsonl"


def test_the_tier_evicts_the_least_recently_used_unpinned_slot():
    tier = OffloadTier(2)
    a, b = tier.store(("a",), 1), tier.store(("b",), 2)
    assert {a, b} == {0, 1} and tier.store(("a",), 1) is None  # known contents: no copy
    tier.unpin()
    assert tier.take(("a",)) == a  # a load pins its slot and makes it most recently used
    assert tier.store(("c",), 3) == b and tier.get(("b",)) is None  # b was least recently used
    assert tier.store(("d",), 4) is None  # a's slot is pinned by this step's load, c's by its store
    tier.unpin()
    assert tier.store(("d",), 4) == a and len(tier) == 2
    assert tier.stats.stored_blocks == 4 and tier.stats.loaded_blocks == 1 and tier.stats.peak_blocks == 2
    unbounded = OffloadTier(None)
    assert [unbounded.store((i,), i) for i in range(5)] == list(range(5))


def _recompute_engine(**tier):
    return LLMEngine("tiny", block_size=4, num_blocks=14, max_num_batched_tokens=24, max_num_seqs=3,
                     preemption_mode="recompute", **tier)


def test_tier_hits_give_the_engine_s_tokens_and_the_round_trip_is_exact():
    lengths, outputs = [9, 23, 5, 17, 30, 12, 21, 8], [7, 12, 9, 5, 10, 8, 6, 11]
    prompts = make_prompts(lengths, shared_prefix=8, seed=5)
    params = [SamplingParams(max_tokens=o, ignore_eos=True) for o in outputs]
    plain = _recompute_engine()
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    engine = _recompute_engine(kv_offload_blocks=8)
    assert [o.token_ids for o in engine.generate(prompts, params)] == expected
    stats = engine.block_manager.offload.stats
    assert stats.loaded_blocks > 0 and stats.stored_blocks > 0
    runner = engine.runner
    for cache in runner.key_caches + runner.value_caches:
        cache[3].normal_()
    before = [cache[3].clone() for cache in runner.key_caches + runner.value_caches]
    runner.swap([(3, 5)], to_host=True)
    runner.swap([(5, 9)], to_host=False)
    assert all(torch.equal(cache[9], old) for cache, old in zip(runner.key_caches + runner.value_caches, before))


def test_swapped_sequences_and_the_tier_share_one_host_pool():
    """The tier borrows free host blocks; a swap-out takes them back from its least recently used entries; the host
    pool's invariants hold and swapped + tier blocks never exceed it."""
    from lab.sched.kv_policy import PagedPolicy
    from lab.sched.scheduler import Sequence, SequenceGroup

    policy = PagedPolicy(6, 2, True, num_cpu_blocks=2, offload_blocks=3)
    host, tier = policy.cpu_manager, policy.tier
    assert host.num_physical_blocks == 5 and tier.host is host and tier.capacity == 5
    for index in range(5):
        assert tier.store((index,), index) == index  # the tier may fill the whole pool while nothing is swapped
    assert tier.store((5,), 5) is None  # every entry is pinned by this step's stores
    tier.unpin()
    assert host.num_free_blocks == 0 and policy.tier_blocks_in_use() == 5 and policy.cpu_blocks_in_use() == 0
    host.check_invariants()
    group = SequenceGroup("r", [])
    seq = Sequence("s", group, 0, prompt_len=5, final_len=8)
    group.seqs.append(seq)
    assert policy.admit([seq], [1, 2, 3, 4, 5])
    kv_len = 5
    assert policy.can_swap_out([seq], [kv_len])
    copies = policy.swap_out([seq], [kv_len])
    assert len(copies) == 3 and policy.cpu_blocks_in_use() == 3 and policy.tier_blocks_in_use() == 2
    assert [key for key in tier.entries] == [(3,), (4,)]  # the three least recently used left
    host.check_invariants()
    assert host.num_used_blocks == 5


def test_a_store_into_a_host_block_a_swap_in_frees_in_the_same_step_lands_after_the_read():
    from lab.sched.scheduler import NOTHING, SchedulerOutput

    engine = LLMEngine("tiny", block_size=4, num_blocks=14, preemption_mode="swap", num_cpu_blocks=4,
                       kv_offload_blocks=4)
    runner = engine.runner
    caches = list(zip(runner.key_caches + runner.value_caches, runner.cpu_key_caches + runner.cpu_value_caches))
    for device, host in caches:
        device[3].normal_()
        host[5].normal_()
    stored, swapped = [d[3].clone() for d, _ in caches], [h[5].clone() for _, h in caches]
    plan = SchedulerOutput(1)
    plan.blocks_to_swap_in, plan.blocks_to_store = [(5, 7)], [(3, 5)]
    assert plan.blocks_to_load is NOTHING or not plan.blocks_to_load
    runner.execute_copies(plan)
    for (device, host), old_device, old_host in zip(caches, stored, swapped):
        assert torch.equal(device[7], old_host) and torch.equal(host[5], old_device)


@pytest.mark.skipif(not MOONCAKE.is_file(), reason=f"{MOONCAKE} not found (../shared/traces)")
def test_an_unbounded_tier_reaches_the_never_evict_bound():
    workload = make_workload(str(MOONCAKE), num_requests=200)
    base = SimConfig(allocator="paged", block_size=16, model="qwen3-8b", gpu="h200", max_model_len=131072,
                     max_num_seqs=4)
    summary, results = compare(workload, [dataclasses.replace(base, kv_offload_blocks=b) for b in (0, None)])
    checks = closed_form_checks(workload, results)
    equal = checks[checks["check"].str.contains("unbounded offload tier")]
    assert len(equal) == 1 and equal["holds"].all(), checks.to_string()
    assert summary["prefix_cache_hit_blocks"].iloc[1] > summary["prefix_cache_hit_blocks"].iloc[0]
    assert summary["offload_hit_rate"].iloc[1] > 0


def test_a_workload_that_shares_nothing_loads_nothing():
    workload = make_workload("sharegpt", num_requests=150, rate=2.0, n=2)  # samples register their prompts
    config = SimConfig(allocator="paged", capacity_tokens=6_000, max_model_len=2048, kv_offload_blocks=32, max_num_seqs=4)
    summary, results = compare(workload, [config])
    assert summary["preemptions"].iloc[0] == 0 and summary["offload_stored_blocks"].iloc[0] > 0
    checks = closed_form_checks(workload, results)
    tier = checks[checks["check"].str.contains("tier")]
    assert len(tier) == 2 and tier["holds"].all(), tier.to_string()
    assert summary["offload_loaded_blocks"].iloc[0] == 0


@pytest.mark.parametrize("settings,message", [
    (dict(allocator="contiguous-max", kv_offload_blocks=8), "allocator='paged'"),
    (dict(kv_offload_blocks=-1), "kv_offload_blocks"),
])
def test_bad_tier_settings_are_named(settings, message):
    workload = make_workload("sharegpt", num_requests=5)
    with pytest.raises(LabError, match=message):
        compare(workload, [SimConfig(capacity_tokens=4000, max_model_len=2048, **settings)])


def test_the_twin_configures_the_simulator_with_the_engine_s_tier():
    from simulator.twins.twin import sim_config
    from tests.test_profile_twin import fixed_profile

    engine = LLMEngine("tiny", block_size=16, num_blocks=64, kv_offload_blocks=12, preemption_mode="swap",
                       num_cpu_blocks=8)
    config = sim_config(engine, fixed_profile())
    assert config.kv_offload_blocks == 12 and config.num_cpu_blocks == 8  # the host pool of 20 is rebuilt alike


def test_the_tier_sweep_shows_what_a_cpu_tier_buys():
    """Shared system prompts on a pool that evicts: hits rise with the tier and never fall; a chart with three panels."""
    from simulator import offload_sweep
    from simulator.views.charts import offload_lines

    workload = make_workload("sharegpt", num_requests=150, rate=20.0, shared_prefix_tokens=256)
    config = SimConfig(capacity_tokens=3000, max_model_len=2048, max_num_seqs=8)
    table = offload_sweep(workload, config, (0.0, 0.01, float("inf")))
    assert list(table["tier"]) == ["0 GiB", "0.01 GiB", "unbounded"]
    hits = table["prefix_cache_hit_pct"].tolist()
    assert hits[0] <= hits[1] <= hits[2] and table["offload_hit_pct"].iloc[0] == 0
    assert len(offload_lines(table).layout.annotations) == 3
    with pytest.raises(LabError, match="must be a number >= 0"):
        offload_sweep(workload, config, (-1.0,))


def test_a_tier_snapshot_ranks_slots_by_recency():
    from lab.kv_cache.offload import OffloadTier
    from lab.kv_cache.pool_view import tier_snapshot

    tier = OffloadTier(4)
    for key in ("a", "b", "c"):
        tier.store((key,), 0)
    tier.unpin()
    tier.take(("a",))  # "a" becomes the most recently used
    snapshot = tier_snapshot(tier)
    slots = {key: slot for key, (slot, _) in tier.entries.items()}
    assert snapshot.lru_rank[slots[("b",)]] == 0 and snapshot.lru_rank[slots[("a",)]] == 2
    assert snapshot.lru_rank.count(-1) == 1 and snapshot.num_used_slots == 3
    assert snapshot.stats.stored_blocks == 3 and snapshot.stats.loaded_blocks == 1
    tier.store(("d",), 0)  # the snapshot is a copy
    assert snapshot.num_used_slots == 3 and snapshot.stats.stored_blocks == 3
    unbounded = OffloadTier(None)
    unbounded.store(("x",), 0)
    assert tier_snapshot(unbounded).lru_rank == [0]


def test_a_cluster_reports_its_replicas_tiers():
    from simulator import SimConfig, SyntheticSpec, run_simulation, synthetic_workload

    workload = synthetic_workload(SyntheticSpec("sharegpt", num_requests=60, rate=20.0, shared_prefix_tokens=256))
    config = SimConfig(allocator="paged", capacity_tokens=3000, kv_offload_blocks=64)
    one = run_simulation(workload, config).summary
    two = run_simulation(workload, dataclasses.replace(config, replicas=2)).summary
    for summary in (one, two):
        assert summary["offload_stored_blocks"] > 0 and 0 < summary["offload_hit_rate"] <= 1
        assert 0 < summary["host_tier_peak_blocks"] <= 64
