"""Model/GPU presets, KV capacity and the roofline cost model."""
import pandas as pd
import pytest

from simulator.core.models import GiB, CostModel, get_gpu, get_model, kv_capacity_tokens, override


def test_preset_shapes_give_known_sizes():
    opt = get_model("OPT-13B")
    assert opt.kv_bytes_per_token == 800 * 1024  # 800 KiB per token, as in the vLLM paper
    assert 12.5e9 < opt.num_params < 13.2e9
    qwen = get_model("qwen3-0.6b")
    assert qwen.kv_bytes_per_token == 2 * 28 * 8 * 128 * 2
    assert 0.55e9 < qwen.num_params < 0.65e9
    assert 7.9e9 < get_model("qwen3-8b").num_params < 8.4e9
    with pytest.raises(ValueError, match="unknown model"):
        get_model("gpt-5")
    with pytest.raises(ValueError, match="unknown GPU"):
        get_gpu("tpu")


def test_kv_capacity_and_overrides():
    model, gpu = get_model("opt-13b"), get_gpu("a100-40gb")
    tokens = kv_capacity_tokens(model, gpu, 0.9, 1 * GiB)
    expected = (40 * GiB * 0.9 - model.weight_bytes - GiB) // model.kv_bytes_per_token
    assert tokens == expected and 10_000 < tokens < 20_000
    with pytest.raises(ValueError, match="leaves no KV memory"):
        kv_capacity_tokens(get_model("qwen3-32b"), get_gpu("l4"))
    bigger = override(gpu, memory_bytes=80 * GiB)
    assert kv_capacity_tokens(model, bigger) > tokens
    with pytest.raises(ValueError, match="unknown GPUSpec field"):
        override(gpu, colour="red")


def test_roofline_regimes():
    cost = CostModel(get_model("qwen3-8b"), get_gpu("h100-80gb"), step_overhead_s=0.0)
    weights_s = cost.model.weight_bytes / (cost.gpu.bandwidth_bytes_s * cost.bandwidth_efficiency)
    assert cost.iteration_time(1, 100, 100) == pytest.approx(weights_s, rel=0.01)  # decode batch 1: weight-bound
    big_prefill = cost.iteration_time(8192, 8192 * 4096, 0)
    flops = 2 * cost.model.matmul_params * 8192
    assert big_prefill >= flops / (cost.gpu.peak_flops * cost.flops_efficiency)  # compute-bound
    assert cost.iteration_time(64, 64 * 4096, 64 * 4096) > cost.iteration_time(64, 64 * 512, 64 * 512)
    assert cost.iteration_time(0, 0, 0) == 0.0
    assert cost.copy_time(1000) == pytest.approx(2 * 1000 * cost.model.kv_bytes_per_token /
                                                 (cost.gpu.bandwidth_bytes_s * cost.bandwidth_efficiency))


def test_calibration_from_kernel_csv(tmp_path):
    path = tmp_path / "k.csv"
    pd.DataFrame({"kernel": ["sdpa-contiguous", "cupy-v1", "cupy-v2", "cupy-v1"], "batch": [64, 64, 64, 1],
                  "context": [4096, 4096, 4096, 512], "kv_gb_per_s": [4000, 3000, 2000, 100]}).to_csv(path)
    cost = CostModel(get_model("qwen3-8b"), get_gpu("h100-80gb"))
    before = cost.iteration_time(64, 64 * 4096, 64 * 4096)
    assert cost.calibrate_from_kernel_csv(path) == pytest.approx(2500e9)
    assert cost.iteration_time(64, 64 * 4096, 64 * 4096) != before
    (tmp_path / "bad.csv").write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="bad.csv: line 1: missing column"):
        cost.calibrate_from_kernel_csv(tmp_path / "bad.csv")


def test_tensor_parallelism_splits_weights_kv_and_work_and_pays_all_reduces():
    model, gpu = get_model("qwen3-32b"), get_gpu("a100-80gb")
    one, two = kv_capacity_tokens(model, gpu, 0.9, 1 * GiB), kv_capacity_tokens(model, gpu, 0.9, 1 * GiB, tp=2)
    assert two > 2 * one  # the weights are split too, so each GPU has more room for its half of the KV
    free = override(gpu, nvlink_bytes_s=1e30, collective_latency_s=1e-30)
    single = CostModel(model, free, step_overhead_s=0.0)
    ideal = CostModel(model, free, step_overhead_s=0.0, tp=2)
    assert ideal.iteration_time(256, 256 * 900, 256 * 900) == pytest.approx(
        single.iteration_time(256, 256 * 900, 256 * 900) / 2, rel=1e-9)
    real = CostModel(model, gpu, step_overhead_s=0.0, tp=2)
    reduces = 2 * model.num_layers * (gpu.collective_latency_s + 256 * model.hidden_size * 2 / gpu.nvlink_bytes_s)
    assert real.iteration_time(256, 256 * 900, 256 * 900) == pytest.approx(
        ideal.iteration_time(256, 256 * 900, 256 * 900) + reduces, rel=1e-9)


@pytest.mark.parametrize("setup", ["opt-13b", "opt-66b", "opt-175b"])
def test_paper_setups_hold_the_kv_slots_of_table_1(setup):
    from simulator.core.engine import resolve_capacity
    from simulator.core.presets import PAPER_TABLE1_KV_SLOTS, paper_config

    capacity, _ = resolve_capacity(paper_config(setup))
    assert capacity == pytest.approx(PAPER_TABLE1_KV_SLOTS[setup], rel=0.10)


def test_attention_depends_on_the_block_size_only_for_paged_kv(tmp_path):
    from simulator.core.models import CostModel, get_gpu, get_model

    model, gpu = get_model("opt-13b"), get_gpu("a100-40gb")
    contiguous = CostModel(model, gpu)
    times = {b: CostModel(model, gpu, block_size=b).iteration_time(64, 64 * 1000, 64 * 1000, 64)
             for b in (1, 4, 16, 64, 256)}
    assert contiguous.block_slowdown == 1.0
    assert times[1] > times[4] > times[16]  # small blocks: the kernel's per-block cost
    assert times[256] > times[64]  # large blocks: each sequence reads its whole last block
    assert CostModel(model, gpu, block_size=1).block_slowdown == pytest.approx(3.0)
    assert contiguous.iteration_time(64, 64 * 1000, 64 * 1000, 64) < times[16]


def test_a_kernel_csv_of_several_block_sizes_gives_the_measured_curve(tmp_path):
    from simulator.core.models import CostModel, get_gpu, get_model

    rows = ["kernel,batch,context,kv_gb_per_s,block_size"]
    for block_size, bandwidth in ((1, 10.0), (4, 20.0), (16, 40.0), (64, 40.0)):
        rows += [f"sdpa-contiguous,32,1024,50.0,{block_size}", f"torch,32,1024,{bandwidth},{block_size}",
                 f"torch,1,512,1.0,{block_size}"]
    path = tmp_path / "kernels.csv"
    path.write_text("\n".join(rows) + "\n")
    cost = CostModel(get_model("opt-13b"), get_gpu("a100-40gb"), block_size=2)
    assert cost.calibrate_from_kernel_csv(path) == pytest.approx(40e9)  # the best block size's bandwidth
    assert cost.block_slowdowns == {1: 4.0, 4: 2.0, 16: 1.0, 64: 1.0}
    assert cost.block_slowdown == pytest.approx(3.0)  # halfway between 1 and 4 on a log scale
    cost.block_size = 256
    assert cost.block_slowdown == 1.0
