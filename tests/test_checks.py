"""Closed-form checks: every check holds on runs across allocators, schedulers, sharing and clusters, and a number
that disagrees with its closed form is flagged."""
import dataclasses
import math

import pytest

from simulator import SimConfig, Simulator, SyntheticSpec, compare, synthetic_workload
from simulator.core.checks import COLUMNS, closed_form_checks

CONFIGS = [SimConfig(allocator=allocator, capacity_tokens=6000, max_model_len=2048, **extra)
           for allocator in ("contiguous-max", "contiguous-oracle", "contiguous-pow2", "contiguous-grow")
           for extra in ({}, {"scheduling": "chunked", "max_num_batched_tokens": 300}, {"address_space": "buddy"})]
CONFIGS += [SimConfig(allocator="paged", block_size=block_size, capacity_tokens=6000, max_model_len=2048, **extra)
            for block_size in (1, 7, 16)
            for extra in ({}, {"scheduling": "chunked", "max_num_batched_tokens": 300},
                          {"preemption_mode": "swap", "num_cpu_blocks": 40})]


@pytest.mark.parametrize("sharing", [{}, {"n": 3}, {"beam_width": 3}, {"shared_prefix_tokens": 64}],
                         ids=["plain", "n3", "beams", "prefix"])
def test_every_closed_form_holds_across_allocators_and_schedulers(sharing):
    num_requests = 60 if "beam_width" in sharing else 120  # beam searches re-fork every step: half the requests
    workload = synthetic_workload(SyntheticSpec(preset="sharegpt", num_requests=num_requests, rate=40.0, seed=3,
                                                max_model_len=2048, **sharing))
    results = {f"{index}": Simulator(workload, config).run() for index, config in enumerate(CONFIGS)}
    checks = closed_form_checks(workload, results)
    assert list(checks.columns) == list(COLUMNS)
    assert checks["holds"].all(), checks[~checks["holds"]].to_string()
    assert set(checks["label"]) == set(results)
    assert sum(r.summary["preemptions"] for r in results.values()) > 0  # the small pools did preempt
    # six for every run; one more with nothing shared; more for max, oracle (first-fit) and paged
    per_run = checks.groupby("label").size()
    assert per_run.min() == 6 + (not sharing) and per_run.max() == 8 + (not sharing)


def test_a_cluster_and_a_trace_pass_too(traces_dir):
    from simulator import load_trace

    workload = load_trace(traces_dir / "azure_llm_2023" / "AzureLLMInferenceTrace_code.csv", max_rows=300)
    configs = [SimConfig(allocator=a, capacity_tokens=40_000, max_model_len=8192, replicas=3, router="least-loaded")
               for a in ("paged", "contiguous-max", "contiguous-oracle")]
    _, results = compare(workload, configs)
    checks = closed_form_checks(workload, results)
    assert checks["holds"].all(), checks[~checks["holds"]].to_string()


def test_a_number_off_its_closed_form_is_flagged():
    workload = synthetic_workload(SyntheticSpec(preset="sharegpt", num_requests=60, rate=40.0, seed=1))
    runs = {"max": Simulator(workload, SimConfig(allocator="contiguous-max", capacity_tokens=20_000)).run(),
            "paged": Simulator(workload, SimConfig(allocator="paged", capacity_tokens=20_000)).run()}
    assert closed_form_checks(workload, runs)["holds"].all()
    tampered = {label: dataclasses.replace(result, summary=dict(result.summary)) for label, result in runs.items()}
    tampered["max"].summary["mean_batch_size"] *= 1.01  # the batch integral no longer matches the memory one
    tampered["paged"].summary["generated_tokens"] -= 1  # a token lost
    tampered["paged"].summary["free_frac"] += 1e-6  # the categories no longer cover the pool
    tampered["paged"].summary["sharing_saving_frac"] = 0.01  # a saving where nothing is shared
    requests = tampered["paged"].requests = tampered["paged"].requests.copy()
    requests.loc[requests.index[0], "first_token_s"] = requests["finish_s"].iloc[0] + 1  # a token after the end
    failed = closed_form_checks(workload, tampered).query("not holds")
    assert set(zip(failed["label"], failed["check"])) == {
        ("max", "held slots = batch x max_model_len (time-weighted)"),
        ("paged", "tokens generated = the completed requests' output tokens"),
        ("paged", "memory categories sum to the pool (fraction)"),
        ("paged", "sharing saving with nothing shared (fraction)"),
        ("paged", "completed requests with arrival <= first token <= finish")}


def test_a_run_stopped_early_skips_what_needs_it_finished():
    workload = synthetic_workload(SyntheticSpec(preset="sharegpt", num_requests=200, rate=math.inf, seed=2))
    result = Simulator(workload, SimConfig(allocator="paged", capacity_tokens=20_000),
                       on_snapshot=lambda snapshot: snapshot.iteration < 30, snapshot_every=10).run()
    assert result.summary["stopped_early"]
    checks = closed_form_checks(workload, {"stopped": result})
    assert checks["holds"].all() and not checks["check"].str.startswith(("requests", "tokens")).any()


def test_the_unbounded_cache_bound_by_hand_and_reached_by_a_pool_that_never_evicts():
    import numpy as np

    from simulator import Workload
    from simulator.core.checks import unbounded_cache_hit_blocks

    # a 64-token system prompt: the second prompt hits its 4 blocks; the third, 40 tokens of it, 2 full blocks
    shared = Workload("hand", np.zeros(3), np.array([100, 100, 40]), np.array([5, 5, 5]), shared_prefix_tokens=64)
    assert unbounded_cache_hit_blocks(shared, 16) == 4 + 2
    assert unbounded_cache_hit_blocks(shared, 64) == 1 + 0  # a lookup leaves the third prompt's last token
    # Mooncake-style 512-token block ids: prompts 2 and 3 repeat prompt 1's first block, prompt 3 its second too
    mooncake = Workload("ids", np.arange(3.0), np.array([1000, 700, 1024]), np.array([4, 4, 4]),
                        prompt_block_ids=[[1, 2], [1, 9], [1, 2]])
    assert unbounded_cache_hit_blocks(mooncake, 16) == 32 + (1000 // 16)  # prompt 1 holds 62 full blocks
    assert unbounded_cache_hit_blocks(Workload("none", np.zeros(2), np.array([50, 50]), np.array([3, 3])), 16) == 0
    for workload in (shared, mooncake, synthetic_workload(SyntheticSpec(preset="sharegpt", num_requests=150,
                                                                        rate=30.0, shared_prefix_tokens=200))):
        for block_size in (1, 3, 16):
            config = SimConfig(allocator="paged", block_size=block_size, capacity_tokens=10**7, max_model_len=4096)
            result = Simulator(workload, config).run()
            assert result.summary["preemptions"] == 0
            assert result.summary["prefix_cache_hit_blocks"] == unbounded_cache_hit_blocks(workload, block_size)
            checks = closed_form_checks(workload, {"run": result})
            assert checks["check"].str.startswith("prefix-cache hit blocks").sum() == 1 and checks["holds"].all()


def test_the_cache_bound_is_left_out_where_it_does_not_apply():
    workload = synthetic_workload(SyntheticSpec(preset="sharegpt", num_requests=200, rate=math.inf,
                                                shared_prefix_tokens=64))
    runs = {"preempting": Simulator(workload, SimConfig(capacity_tokens=4000)).run(),
            "no caching": Simulator(workload, SimConfig(enable_prefix_caching=False)).run(),
            "contiguous": Simulator(workload, SimConfig(allocator="contiguous-oracle")).run()}
    assert runs["preempting"].summary["preemptions"] > 0
    checks = closed_form_checks(workload, runs)
    assert not checks["check"].str.startswith("prefix-cache").any() and checks["holds"].all()
