"""Swapping KV blocks between a device pool and a host pool: the kernel op and its contract."""
import numpy as np
import pytest
import torch

import paged_kernels


def caches(num_blocks, dtype=torch.float32, device="cpu"):
    shape = (num_blocks, 2, 3, 8)
    return torch.randn(shape, dtype=dtype, device=device), torch.randn(shape, dtype=dtype, device=device)


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_swapped_blocks_come_back_bit_identical(backend):
    gpu_k, gpu_v = caches(10)
    cpu_k, cpu_v = torch.zeros(6, 2, 3, 8), torch.zeros(6, 2, 3, 8)
    original_k, original_v = gpu_k[[1, 4, 7]].clone(), gpu_v[[1, 4, 7]].clone()
    paged_kernels.swap_blocks(gpu_k, gpu_v, cpu_k, cpu_v, [(1, 5), (4, 0), (7, 2)], backend=backend)
    gpu_k[[1, 4, 7]], gpu_v[[1, 4, 7]] = float("nan"), float("nan")  # the device blocks are reused meanwhile
    paged_kernels.swap_blocks(cpu_k, cpu_v, gpu_k, gpu_v, [(5, 9), (0, 3), (2, 1)], backend=backend)
    assert torch.equal(gpu_k[[9, 3, 1]], original_k) and torch.equal(gpu_v[[9, 3, 1]], original_v)


def test_numpy_caches_swap_too():
    src_k, src_v = np.random.rand(4, 1, 2, 2), np.random.rand(4, 1, 2, 2)
    dst_k, dst_v = np.zeros((3, 1, 2, 2)), np.zeros((3, 1, 2, 2))
    paged_kernels.swap_blocks(src_k, src_v, dst_k, dst_v, np.array([[3, 0], [1, 2]]))
    assert np.array_equal(dst_k[0], src_k[3]) and np.array_equal(dst_v[2], src_v[1])


@pytest.mark.parametrize("mapping,message", [
    ([(0, 6)], "destination block outside"), ([(10, 0)], "source block outside"), ([(-1, 0)], "source block outside"),
    ([(0, 1), (2, 1)], "destination block twice"), ([(0, 1, 2)], "pairs"), (np.array([[0.5, 1]]), "pairs"),
])
def test_bad_mappings_raise_and_change_nothing(mapping, message):
    gpu_k, gpu_v = caches(10)
    cpu_k, cpu_v = caches(6)
    before = cpu_k.clone(), cpu_v.clone()
    with pytest.raises(ValueError, match=message):
        paged_kernels.swap_blocks(gpu_k, gpu_v, cpu_k, cpu_v, mapping)
    assert torch.equal(cpu_k, before[0]) and torch.equal(cpu_v, before[1])


def test_mismatched_pools_are_rejected():
    gpu_k, gpu_v = caches(4)
    with pytest.raises(ValueError, match="differ in shape"):
        paged_kernels.swap_blocks(gpu_k, gpu_v, torch.zeros(4, 2, 3, 4), torch.zeros(4, 2, 3, 4), [(0, 0)])
    with pytest.raises(ValueError, match="dtype"):
        paged_kernels.swap_blocks(gpu_k, gpu_v, torch.zeros(4, 2, 3, 8, dtype=torch.float64),
                            torch.zeros(4, 2, 3, 8, dtype=torch.float64), [(0, 0)])


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "cupy"])
def test_swap_between_cuda_and_pinned_host(backend):
    if backend not in paged_kernels.available_backends():
        pytest.skip(f"{backend} cannot run here")
    gpu_k, gpu_v = caches(64, torch.bfloat16, "cuda")
    cpu_k = torch.zeros(32, 2, 3, 8, dtype=torch.bfloat16).pin_memory()
    cpu_v = torch.zeros_like(cpu_k).pin_memory()
    original = gpu_k[[3, 40]].clone(), gpu_v[[3, 40]].clone()
    paged_kernels.swap_blocks(gpu_k, gpu_v, cpu_k, cpu_v, [(3, 0), (40, 31)], backend=backend)
    gpu_k.zero_(), gpu_v.zero_()
    paged_kernels.swap_blocks(cpu_k, cpu_v, gpu_k, gpu_v, [(0, 10), (31, 11)], backend=backend)
    torch.cuda.synchronize()
    assert torch.equal(gpu_k[[10, 11]], original[0]) and torch.equal(gpu_v[[10, 11]], original[1])


def test_a_device_to_host_swap_waits_for_the_stream_before_the_cpu_writes(monkeypatch):
    """A non-blocking device -> host copy lands whenever the stream reaches it, so the torch backend must wait for
    the stream before the CPU writes the host pool (the PyTorch guide: ``cuda_tensor.to("cpu", non_blocking=True)``
    read at once gives wrong values). CPU tensors stand in for the device pool here; the ``gpu`` test below delays a
    real stream."""
    from paged_kernels import torch_backend

    gpu_k, gpu_v = caches(6)
    cpu_k, cpu_v = torch.zeros(4, 2, 3, 8), torch.zeros(4, 2, 3, 8)
    host_when_waited = []
    monkeypatch.setattr(torch_backend, "is_cuda", lambda tensor: tensor is gpu_k or tensor is gpu_v)
    monkeypatch.setattr(torch_backend, "synchronize", lambda device: host_when_waited.append(cpu_k.clone()))
    paged_kernels.swap_blocks(gpu_k, gpu_v, cpu_k, cpu_v, [(5, 1), (2, 3)], backend="torch")
    assert len(host_when_waited) == 1 and not host_when_waited[0].any(), "waited once, before writing the host pool"
    assert torch.equal(cpu_k[[1, 3]], gpu_k[[5, 2]]) and torch.equal(cpu_v[[1, 3]], gpu_v[[5, 2]])
    paged_kernels.swap_blocks(cpu_k, cpu_v, gpu_k, gpu_v, [(1, 0)], backend="torch")  # host -> device: no wait
    assert len(host_when_waited) == 1 and torch.equal(gpu_k[0], gpu_k[5])


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "cupy"])
def test_swap_out_behind_queued_gpu_work_stores_the_right_blocks(backend):
    """The stream is busy (a spin queued first) when the blocks are swapped out: the host pool must still get their
    values. The torch backend writes the host pool on the CPU, so it must wait for the stream first; the cupy backend
    copies straight into the pinned pool on the stream, so the caller's synchronize is what makes it readable."""
    if backend not in paged_kernels.available_backends():
        pytest.skip(f"{backend} cannot run here")
    gpu_k, gpu_v = caches(64, torch.float16, "cuda")
    cpu_k = torch.full((16, 2, 3, 8), 7.0, dtype=torch.float16).pin_memory()
    cpu_v = torch.full_like(cpu_k, 7.0).pin_memory()
    original = gpu_k[[5, 60]].cpu(), gpu_v[[5, 60]].cpu()
    torch.cuda._sleep(100_000_000)  # keeps the stream busy for tens of milliseconds
    paged_kernels.swap_blocks(gpu_k, gpu_v, cpu_k, cpu_v, [(5, 2), (60, 9)], backend=backend)
    torch.cuda.synchronize()
    assert torch.equal(cpu_k[[2, 9]], original[0]) and torch.equal(cpu_v[[2, 9]], original[1])


def test_the_default_host_pool_is_the_device_pool_capped_at_vllm_s_swap_space(monkeypatch):
    """Swap preemption with no host pool size: as many blocks as the device pool, but at most vLLM's default 4 GiB
    of swap space per GPU, in the engine and the simulator alike (an H200's pool, sized from its free memory, would
    otherwise ask for more pinned host memory than the machine has)."""
    import numpy as np

    import lab.sched.kv_policy as kv_policy
    from lab.engine import LLMEngine
    from simulator import SimConfig, Simulator, Workload

    assert kv_policy.default_num_cpu_blocks(100, 1 << 20) == 100
    assert kv_policy.default_num_cpu_blocks(10_000, 1 << 20) == 4096  # 4 GiB of 1 MiB blocks
    workload = Workload("one", np.zeros(1), np.array([8]), np.array([4]))
    config = SimConfig(model="qwen3-8b", gpu="h200", block_size=16, preemption_mode="swap")
    simulator = Simulator(workload, config)
    block_bytes = simulator.cost.model.kv_bytes_per_token * 16
    assert simulator.policy.manager.num_physical_blocks > 4 * (1 << 30) // block_bytes
    assert simulator.policy.cpu_manager.num_physical_blocks == (4 << 30) // block_bytes
    summary = simulator.run().summary  # the host pool is reported, in slots
    assert summary["host_capacity_tokens"] == (4 << 30) // block_bytes * 16
    from dataclasses import replace
    assert Simulator(workload, replace(config, preemption_mode="recompute")).run().summary["host_capacity_tokens"] == 0
    from simulator.core.cluster import run_simulation
    two = run_simulation(workload, replace(config, replicas=2)).summary
    assert two["host_capacity_tokens"] == 2 * summary["host_capacity_tokens"]
    small = LLMEngine("tiny", num_blocks=40, block_size=4, preemption_mode="swap")
    assert small.policy.cpu_manager.num_physical_blocks == 40
    monkeypatch.setattr(kv_policy, "DEFAULT_SWAP_SPACE_BYTES", 10 * small.runner.kv_bytes_per_block(
        small.hf_model.config, 4, small.runner.dtype))
    capped = LLMEngine("tiny", num_blocks=40, block_size=4, preemption_mode="swap")
    assert capped.policy.cpu_manager.num_physical_blocks == 10
    assert LLMEngine("tiny", num_blocks=40, block_size=4, preemption_mode="swap",
                     num_cpu_blocks=30).policy.cpu_manager.num_physical_blocks == 30  # a size given is kept
