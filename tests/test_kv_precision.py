"""KV precision as a dimension of the simulator and the planner: an FP8 KV cache stores one byte per element, so a
token's KV is exactly half of fp16's, every allocator holds twice the tokens (up to whole blocks), and a plan can
find a cheaper configuration with it."""
import pandas as pd
import pytest

import simulator
from lab.errors import InputError
from lab.kv_cache.precision import FP8_KV_CACHE_DTYPES, KV_CACHE_DTYPES, kv_element_bytes
from simulator.core.engine import SimConfig, resolve_capacity
from simulator.core.models import MODELS
from simulator.core.runs import default_inputs
from simulator.experiments.plan import RateSearch, plan_specs, run_plan


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("dtype", FP8_KV_CACHE_DTYPES)
def test_a_token_s_fp8_kv_is_half_of_fp16_s(model, dtype):
    auto = resolve_capacity(SimConfig(model=model, gpu="h100-80gb", capacity_tokens=1024))[1].model
    fp8 = resolve_capacity(SimConfig(model=model, gpu="h100-80gb", capacity_tokens=1024, kv_cache_dtype=dtype))[1].model
    assert auto.dtype_bytes == 2 and 2 * fp8.kv_bytes_per_token == auto.kv_bytes_per_token
    assert fp8.weight_bytes == auto.weight_bytes  # the weights keep their dtype


def test_every_allocator_holds_twice_the_tokens_at_the_app_s_defaults():
    workload, configs = default_inputs(num_requests=20)
    for config in configs:
        auto = simulator.simulate(workload, config).summary
        fp8 = simulator.simulate(workload, SimConfig(**{**_fields(config), "kv_cache_dtype": "fp8"})).summary
        assert auto["kv_cache_dtype"] == "auto" and fp8["kv_cache_dtype"] == "fp8"
        whole = config.block_size if config.allocator == "paged" else 1
        assert 2 * auto["capacity_tokens"] <= fp8["capacity_tokens"] <= 2 * auto["capacity_tokens"] + whole, config
        assert fp8["kv_capacity_gib"] == pytest.approx(auto["kv_capacity_gib"], rel=1e-3)  # the same memory


def _fields(config):
    from dataclasses import fields
    return {f.name: getattr(config, f.name) for f in fields(config)}


def test_fp8_changes_the_cheapest_configuration_of_a_plan():
    """qwen3-8b with a 0.5 s TTFT p90 and 0.1 s TPOT p90 at 4 requests/s: an L4 falls short with a bf16 KV cache
    (the A100 is chosen, 4.6x the price) and sustains it with FP8 KV."""
    workload, slos = {"workload": "sharegpt", "num_requests": 120}, {"ttft_p90_s": 0.5, "tpot_p90_s": 0.1}
    chosen = {}
    for dtype in ("auto", "fp8"):
        specs = plan_specs(workload, ["qwen3-8b"], ["l4", "a100-80gb"], [1], [1], ["paged"],
                           kv_cache_dtypes=[dtype], block_size=16)
        table = run_plan(specs, slos, RateSearch(start=2.0, tolerance=0.1), target_rate=4.0, parallel=False,
                         progress=False).table
        assert (table["kv_cache_dtype"] == dtype).all()
        chosen[dtype] = table[table["chosen"]].iloc[0]["gpu"]
    assert chosen == {"auto": "a100-80gb", "fp8": "l4"}


def test_a_kv_cache_dtype_is_checked_and_a_profile_refuses_fp8():
    assert set(KV_CACHE_DTYPES) == {"auto", "fp8", "fp8_e4m3", "fp8_e5m2"}
    assert kv_element_bytes("auto", 4) == 4 and kv_element_bytes("fp8_e5m2", 2) == 1
    workload = simulator.make_workload("sharegpt", num_requests=5)
    with pytest.raises(InputError, match="kv_cache_dtype"):
        simulator.simulate(workload, SimConfig(kv_cache_dtype="int4"))
    with pytest.raises(InputError, match="profile"):
        simulator.simulate(workload, SimConfig(kv_cache_dtype="fp8", profile="x.json", capacity_tokens=1024))


def test_the_plan_cli_and_a_sweep_grid_take_the_kv_cache_dtype(tmp_path):
    from simulator.experiments.sweep import check_grid, expand

    grid = check_grid({"kv_cache_dtype": ["auto", "fp8"], "num_requests": [10]})
    assert [spec["kv_cache_dtype"] for spec in expand(grid)] == ["auto", "fp8"]
    from simulator.cli.sweep import kv_dtype_list
    assert kv_dtype_list("auto,fp8") == ["auto", "fp8"]
    import argparse
    with pytest.raises(argparse.ArgumentTypeError, match="int8"):
        kv_dtype_list("auto,int8")


def test_the_recorded_precision_gains_are_the_memory_simulator_s_cards(tmp_path):
    """`python -m simulator.bench --precision` records what the Memory simulator's cards show at its defaults: the
    paged run of highest throughput and the best contiguous one, each with and without FP8; FP8 doubles the capacity
    of both (to whole blocks) and more than doubles nothing it cannot."""
    from simulator.bench import main

    out = tmp_path / "gains.csv"
    assert main(["--precision", "--out", str(out)]) == 0
    table = pd.read_csv(out, comment="#").set_index("step")
    assert list(table.index) == ["baseline", "paging", "fp8", "together"]
    assert table.loc["fp8", "capacity_tokens_x"] == pytest.approx(2.0, rel=0.01)
    assert table.loc["together", "capacity_tokens"] == pytest.approx(2 * table.loc["paging", "capacity_tokens"],
                                                                     rel=0.01)
    assert table.loc["together", "mean_batch_size_x"] > max(table.loc["paging", "mean_batch_size_x"],
                                                            table.loc["fp8", "mean_batch_size_x"]) > 1
