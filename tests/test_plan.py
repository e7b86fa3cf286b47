"""Capacity planning: the rate search stops where the SLO flips, prices are per GPU-hour, the cheapest feasible
configuration is chosen; Ray and serial plans agree."""
import math

import pytest

from simulator.experiments.plan import PlanError, RateSearch, meets, parse_slos, plan_specs, run_plan, search_max_rate
from simulator.experiments.sweep import run_one

WORKLOAD = {"workload": "sharegpt", "num_requests": 120}
SLOS = {"ttft_p90_s": 0.5, "tpot_p90_s": 0.1}


def small_specs(**lists):
    base = dict(models=["qwen3-8b"], gpus=["l4"], tps=[1], replicas=[1], allocators=["paged"])
    return plan_specs(WORKLOAD, **{**base, **lists}, block_size=16)


def test_the_search_stops_where_the_slo_flips():
    spec = small_specs()[0]
    found = search_max_rate(spec, SLOS, RateSearch(start=1.0, tolerance=0.05))
    low, high = found["max_rate_req_s"], found["first_failing_rate_req_s"]
    assert 0 < low < high <= low * 1.05
    assert meets(run_one({**spec, "rate": low}), SLOS)
    assert not meets(run_one({**spec, "rate": high}), SLOS)
    assert found["simulations"] < 20


def test_an_infeasible_configuration_has_rate_zero_and_says_why():
    spec = small_specs(models=["qwen3-32b"])[0]  # 64 GB of weights on a 24 GB GPU
    found = search_max_rate(spec, SLOS, RateSearch(max_steps=2))
    assert found["max_rate_req_s"] == 0 and "leaves no KV memory" in found["error"]


def test_cheapest_configuration_meeting_the_target_is_chosen():
    specs = small_specs(gpus=["l4", "a100-80gb"], replicas=[1, 2])
    table = run_plan(specs, SLOS, RateSearch(start=2.0, tolerance=0.1), target_rate=4.0, parallel=False,
                     progress=False).table
    assert table["chosen"].sum() == 1
    chosen = table[table["chosen"]].iloc[0]
    feasible = table[table["max_rate_req_s"] >= 4.0]
    assert chosen["cost_per_hour"] == feasible["cost_per_hour"].min()
    assert (table["cost_per_hour"] == table["gpus"] * table["gpu"].map({"l4": 0.8, "a100-80gb": 3.7})).all()
    repriced = run_plan(specs[:1], SLOS, RateSearch(start=2.0, tolerance=0.1), prices={"l4": 5.0}, parallel=False,
                        progress=False).table
    assert repriced["cost_per_hour"].iloc[0] == 5.0


def test_ray_and_serial_plans_agree(tmp_path):
    ray = pytest.importorskip("ray")
    from pathlib import Path
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True,
             runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parent.parent)}})
    try:
        specs = small_specs(replicas=[1, 2])
        search = RateSearch(start=2.0, tolerance=0.1)
        on_ray = run_plan(specs, SLOS, search, parallel=True, progress=False).table
        serial = run_plan(specs, SLOS, search, parallel=False, progress=False).table
        assert on_ray["max_rate_req_s"].tolist() == serial["max_rate_req_s"].tolist()
    finally:
        ray.shutdown()


@pytest.mark.parametrize("text,message", [("", "at least one SLO"), ("ttft_p91=1", "expected one of"),
                                          ("ttft_p90=x", "seconds"), ("tpot_p50=-1", "> 0"),
                                          ("e2e_p99=inf", "finite")])
def test_bad_slos(text, message):
    with pytest.raises(PlanError, match=message):
        parse_slos(text)


def test_bad_plan_lists():
    with pytest.raises(PlanError, match="unknown model"):
        small_specs(models=["gpt5"])
    with pytest.raises(PlanError, match="no configuration"):
        small_specs(replicas=[])
    with pytest.raises(PlanError, match="tp"):
        small_specs(tps=[0])
    assert math.isclose(parse_slos("ttft_p90=2,tpot_p90=0.2")["tpot_p90_s"], 0.2)


def test_an_offload_tier_is_a_plan_dimension_with_a_host_price():
    """Tier sizes multiply the paged configurations only, each run converting GiB to its model's blocks; each
    replica's tier is charged per GiB-hour."""
    workload = {"workload": "sharegpt", "num_requests": 120, "shared_prefix_tokens": 512}
    specs = plan_specs(workload, ["qwen3-8b"], ["l4"], [1], [2], ["paged", "contiguous-oracle"], [0.0, 16.0],
                       block_size=16)
    assert [(s["allocator"], s["kv_offload_gib"]) for s in specs] == [("paged", 0.0), ("paged", 16.0),
                                                                       ("contiguous-oracle", 0.0)]
    table = run_plan(specs, SLOS, RateSearch(start=2.0, tolerance=0.1), parallel=False, progress=False,
                     host_price_per_gib_hour=0.01).table
    assert table["host_cost_per_hour"].tolist() == [0.0, 2 * 16 * 0.01, 0.0]  # two replicas, a tier each
    assert table["cost_per_hour"].tolist() == pytest.approx([1.6, 1.6 + 0.32, 1.6])
    assert table["offload_hit_rate"].notna().tolist() == [False, True, False]  # the tier ran where it was asked
    for bad in ([-1.0], [math.inf], ["8"]):
        with pytest.raises(PlanError, match="offload tier"):
            plan_specs(workload, ["qwen3-8b"], ["l4"], [1], [1], ["paged"], bad)
