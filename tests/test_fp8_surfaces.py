"""Where FP8 KV caches show (issue 71): the kernel precision table, the runtime comparison, the simulator's
precision gains, the accuracy benchmark; each reached without Streamlit."""
import pytest

import simulator
from lab.bench.kernels import KernelBenchConfig, run_precision_bench
from lab.bench.kv_precision import KVPrecisionBenchConfig, run_kv_precision_bench
from lab.engine.live import RuntimeRunConfig, compare_kv_precision
from lab.errors import InputError
from simulator.views import report


def test_the_kernel_precision_table_times_and_checks_each_cache():
    config = KernelBenchConfig(batch_sizes=(2,), context_lens=(64,), num_q_heads=4, num_kv_heads=2, head_dim=64,
                               block_size=16, repeats=2)
    table = run_precision_bench(config, context=50, batch=3).set_index("kv_cache_dtype")
    assert list(table.index) == ["auto", "fp8_e4m3", "fp8_e5m2"]
    assert (table["kernel_rel_err"] < 1e-5).all()  # the kernel's arithmetic over what the cache holds
    assert table.at["auto", "rel_err_vs_fp64"] < 1e-5 < table.at["fp8_e4m3", "rel_err_vs_fp64"] \
        < table.at["fp8_e5m2", "rel_err_vs_fp64"] < 0.2
    assert table.at["auto", "kv_bytes"] == 4 * table.at["fp8_e4m3", "kv_bytes"]  # float32 against one byte
    assert table.at["auto", "vs_auto"] == 1.0 and (table["median_ms"] > 0).all()


def test_the_runtime_comparison_serves_both_caches_on_one_pool():
    from lab.engine import EngineConfig

    config = RuntimeRunConfig(num_requests=3, prompt_len_range=(8, 20), max_tokens_range=(4, 6),
                              engine=EngineConfig(num_blocks=32, max_num_seqs=4))
    table = compare_kv_precision(config, "fp8_e4m3").set_index("kv_cache_dtype")
    assert list(table.index) == ["auto", "fp8_e4m3"]
    assert table.at["auto", "token_agreement"] == 1.0 and 0 <= table.at["fp8_e4m3", "token_agreement"] <= 1
    assert (table["num_kv_blocks"] == 32).all()
    assert table.at["auto", "kv_bytes_per_block"] == 4 * table.at["fp8_e4m3", "kv_bytes_per_block"]
    with pytest.raises(InputError, match="FP8"):
        compare_kv_precision(config, "auto")


def test_precision_gains_name_paging_fp8_and_both():
    """On a memory-bound setup (the vLLM paper's OPT-13B on an A100-40GB, all requests at once) FP8 doubles the KV
    capacity in tokens and runs more sequences; the cards' text names the three factors."""
    workload = simulator.make_workload("sharegpt", num_requests=200, rate=float("inf"))
    contiguous, paged = simulator.make_configs(["contiguous-max", "paged"], [16], model="opt-13b", gpu="a100-40gb")
    table = simulator.precision_gains(workload, paged, contiguous, "fp8_e4m3").set_index("step")
    assert list(table.index) == ["baseline", "paging", "fp8", "together"]
    assert table.at["fp8", "capacity_tokens_x"] == pytest.approx(2.0, rel=1e-3)
    assert table.at["together", "mean_batch_size_x"] > table.at["paging", "mean_batch_size_x"] > 1.0
    assert table.at["together", "mean_batch_size_x"] > table.at["fp8", "mean_batch_size_x"] > 1.0
    value, comparison = report.precision_card(table.reset_index(), "mean_batch_size")
    assert value == f"together ×{table.at['together', 'mean_batch_size_x']:.2f}"
    assert comparison == (f"paging ×{table.at['paging', 'mean_batch_size_x']:.2f}, "
                          f"FP8 ×{table.at['fp8', 'mean_batch_size_x']:.2f}")
    with pytest.raises(InputError, match="FP8"):
        simulator.precision_gains(workload, paged, contiguous, "auto")
    with pytest.raises(InputError, match="a paged and a contiguous"):
        simulator.precision_gains(workload, contiguous, paged)


def test_the_accuracy_bench_teacher_forces_and_measures():
    """The baseline row is exact against itself; each FP8 run follows the baseline's tokens (teacher forcing: every
    step compared on the same history) and shows FP8's error, e5m2's larger than e4m3's at the first layer."""
    config = KVPrecisionBenchConfig(models=("tiny",), num_prompts=2, prompt_len=20, max_tokens=4)
    table = run_kv_precision_bench(config)
    assert list(table["kv_cache_dtype"]) == ["auto", "fp8_e4m3", "fp8_e4m3", "fp8_e5m2", "fp8_e5m2"]
    base, runs = table.iloc[0], table.iloc[1:]
    assert base["attn_rel_err"] == 0 and base["top1_agreement"] == 1 and base["positions"] == 8
    assert (runs["attn_rel_err_layer0"] > 1e-4).all() and (runs["logits_rel_err"] < 1).all()
    e4m3 = runs[runs["kv_cache_dtype"] == "fp8_e4m3"]["attn_rel_err_layer0"].max()
    e5m2 = runs[runs["kv_cache_dtype"] == "fp8_e5m2"]["attn_rel_err_layer0"].min()
    assert e4m3 < e5m2
    calculated = runs[runs["scales"] == "calculated"]
    assert (calculated["k_scale_mean"] != 1.0).all()
    with pytest.raises(InputError, match="kv_cache_dtypes"):
        run_kv_precision_bench(KVPrecisionBenchConfig(kv_cache_dtypes=("auto",)))
