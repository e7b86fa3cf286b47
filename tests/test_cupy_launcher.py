"""The CuPy launcher checked without a GPU: every launch goes to a recorder instead of the device, and the recorder
checks what the kernels would be given (grid, block, shared memory, argument dtypes and strides)."""
from dataclasses import dataclass

import numpy as np
import pytest
import torch

import paged_kernels
from paged_kernels import cupy_backend


@dataclass
class Launch:
    kernel: str
    grid: tuple
    block: tuple
    args: tuple
    shared_mem: int


@pytest.fixture
def launches(monkeypatch):
    """Stand in for a GPU: CPU tensors count as CUDA, kernels are names, launches are recorded. The attention
    kernel's stand-in writes 0, 1, 2, ... into the dense output it is given, like the real kernel's layout."""
    recorded = []

    def record(kernel, grid, block, args, device, shared_mem=0):
        for arg in args:
            if isinstance(arg, torch.Tensor):
                rows = kernel.startswith("qk_norm_rope_write") and arg.dim() == 3 and arg.stride(2) == 1 and \
                    arg.stride(1) == arg.shape[2]  # that kernel takes each token's heads at a row stride
                assert arg.is_contiguous() or rows, f"{kernel} would get a strided tensor"
        if kernel.startswith("paged_attention_kernel") and int(args[13]) == 0:
            out = args[0]
            out.view(-1).copy_(torch.arange(out.numel(), dtype=out.dtype))
        recorded.append(Launch(kernel, tuple(grid), tuple(block), tuple(args), shared_mem))

    monkeypatch.setattr(cupy_backend, "_launch", record)
    monkeypatch.setattr(cupy_backend, "_kernel", lambda name, *rest: name)
    monkeypatch.setattr(cupy_backend, "_sm_count", lambda device: 132)
    monkeypatch.setattr(cupy_backend, "is_cuda", lambda tensor: True)
    monkeypatch.setattr(paged_kernels, "cupy_status", lambda: (True, "ok"))
    return recorded


def decode_inputs(num_seqs=3, num_kv_heads=2, group=2, head_dim=128, block_size=16, seq_len=40,
                  dtype=torch.bfloat16):
    blocks = -(-seq_len // block_size)
    cache = torch.zeros(num_seqs * blocks + 1, num_kv_heads, block_size, head_dim, dtype=dtype)
    tables = torch.arange(num_seqs * blocks, dtype=torch.int32).view(num_seqs, blocks)
    seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32)
    query = torch.randn(num_seqs, num_kv_heads * group, head_dim).to(dtype)
    return query, cache, cache.clone(), tables, seq_lens


def test_qwen3_06b_launch_geometry(launches):
    query, kc, vc, tables, lens = decode_inputs(num_seqs=5, num_kv_heads=8, group=2, head_dim=128)
    cupy_backend.paged_attention_decode(query, kc, vc, tables, lens, 128 ** -0.5, partition_size=0)
    (launch,) = launches
    assert launch.kernel == "paged_attention_kernel<bf16_t,128,2,4>"
    assert launch.grid == (8, 5, 1) and launch.block == (128,)
    assert launch.shared_mem == cupy_backend.attention_shared_bytes(128, 2) == 3 * 2 * 130 * 4
    out, _, _, _, q, k, v, table_arg, lens_arg = launch.args[:9]
    assert out.dtype == q.dtype == k.dtype == torch.bfloat16 and k is kc and v is vc
    assert table_arg.dtype == lens_arg.dtype == torch.int32
    assert [type(a) for a in launch.args[9:]] == [np.float32] + [np.int32] * 6 + [np.float32] * 2
    assert launch.args[16:] == (1.0, 1.0)  # k_scale, v_scale: ignored by caches of the model's dtype
    assert int(launch.args[12]) == tables.shape[1] and int(launch.args[15]) == 0


def test_permuted_query_and_strided_out_get_a_dense_kernel_buffer(launches):
    query, kc, vc, tables, lens = decode_inputs(num_seqs=3, group=2, dtype=torch.float32)
    permuted = query.transpose(0, 1).contiguous().transpose(0, 1)  # dense, but not row-major
    assert not permuted.is_contiguous()
    dense_order = torch.arange(query.numel(), dtype=torch.float32).view(query.shape)
    result = cupy_backend.paged_attention_decode(permuted, kc, vc, tables, lens, 1.0, partition_size=0)
    assert result.is_contiguous() and torch.equal(result, dense_order)
    out = torch.full(query.shape[::-1], float("nan")).transpose(0, 2)  # strided out
    returned = paged_kernels.paged_attention_decode(permuted, kc, vc, tables, lens, backend="cupy", out=out)
    assert returned is out and torch.equal(out, dense_order)


def test_split_k_launches_attention_then_reduction(launches):
    query, kc, vc, tables, lens = decode_inputs(num_seqs=2, head_dim=64, block_size=7, seq_len=1300,
                                                dtype=torch.float16)
    cupy_backend.paged_attention_decode(query, kc, vc, tables, lens, 0.125, partition_size=512)
    attention, reduce = launches
    assert attention.grid == (2, 2, 3) and int(attention.args[13]) == 512 and int(attention.args[14]) == 3
    assert reduce.kernel == "reduce_partitions_kernel<half_t,64>" and reduce.grid == (4, 2) and reduce.block == (64,)
    partial_out = attention.args[3]
    assert partial_out.shape == (2, 4, 3, 64) and partial_out.dtype == torch.float32


def test_huge_batches_are_tiled_under_the_grid_limit(launches):
    num_seqs = cupy_backend.MAX_GRID_YZ + 10
    query, kc, vc, tables, lens = decode_inputs(num_seqs=num_seqs, num_kv_heads=1, group=1, head_dim=64,
                                                block_size=1, seq_len=1, dtype=torch.float16)
    cupy_backend.paged_attention_decode(query, kc, vc, tables, lens, 0.125)
    assert [(launch.grid, int(launch.args[15])) for launch in launches] == [
        ((1, cupy_backend.MAX_GRID_YZ, 1), 0), ((1, 10, 1), cupy_backend.MAX_GRID_YZ)]
    assert all(launch.grid[1] <= cupy_backend.MAX_GRID_YZ for launch in launches)


def test_partition_count_stays_under_the_grid_limit():
    from paged_kernels.cupy_backend import MAX_GRID_YZ, PARTITION_SIZE, choose_partition_size

    huge = PARTITION_SIZE * MAX_GRID_YZ + 1
    size = choose_partition_size(1, 1, huge, 132)
    assert size == 2 * PARTITION_SIZE and -(-huge // size) <= MAX_GRID_YZ


def test_forced_partition_past_the_grid_limit_raises(launches, monkeypatch):
    query, kc, vc, tables, lens = decode_inputs(num_seqs=1, head_dim=64, seq_len=70_000, block_size=256,
                                                dtype=torch.float16)
    with pytest.raises(ValueError, match="partitions; the grid allows"):
        cupy_backend.paged_attention_decode(query, kc, vc, tables, lens, 0.125, partition_size=1)
    assert launches == []


def test_write_and_copy_take_any_head_dim(launches):
    cache = torch.zeros(6, 2, 3, 8, dtype=torch.bfloat16)
    key = torch.randn(4, 2, 8).to(torch.bfloat16)
    paged_kernels.write_kv_cache(key, key, cache, cache.clone(), torch.tensor([0, -1, 5, 7]), backend="cupy")
    paged_kernels.copy_blocks(cache, cache.clone(), [(0, 4), (2, 5)], backend="cupy")
    write, copy = launches
    assert write.kernel == "write_kv_cache_kernel<bf16_t>" and write.grid == (4,) and write.block == (32,)
    assert write.args[4].dtype == torch.int64
    assert copy.grid == (2,) and copy.args[2].tolist() == [[0, 4], [2, 5]] and int(copy.args[3]) == 2 * 3 * 8


@pytest.mark.parametrize("mapping,rounds", [
    ([(0, 4), (2, 5)], [[(0, 4), (2, 5)]]),
    ([(0, 4), (4, 5)], [[(0, 4)], [(4, 5)]]),  # reads what the first pair wrote
    ([(4, 5), (0, 4)], [[(4, 5)], [(0, 4)]]),  # overwrites what the first pair reads
    ([(0, 3), (1, 3)], [[(0, 3)], [(1, 3)]]),  # same destination twice: the last one wins
    ([(0, 1), (1, 2), (2, 3)], [[(0, 1)], [(1, 2)], [(2, 3)]]),
])
def test_copy_rounds_keep_the_in_order_meaning(launches, mapping, rounds):
    assert [r.tolist() for r in cupy_backend.copy_rounds(np.array(mapping))] == [list(map(list, r)) for r in rounds]
    cache = torch.zeros(6, 1, 2, 4)
    paged_kernels.copy_blocks(cache, cache.clone(), mapping, backend="cupy")
    assert [launch.args[2].tolist() for launch in launches] == [list(map(list, r)) for r in rounds]


@pytest.mark.parametrize("dtype,head_dim,group,expected", [
    (torch.bfloat16, 128, 2, "cupy"), (torch.float16, 64, 8, "cupy"), (torch.float32, 256, 1, "cupy"),
    (torch.bfloat16, 32, 2, "torch"),  # the tiny preset
    (torch.float16, 96, 1, "torch"), (torch.float64, 128, 1, "torch"), (torch.bfloat16, 128, 16, "torch"),
])
def test_auto_picks_a_backend_that_can_run(launches, dtype, head_dim, group, expected):
    probe = torch.empty(0, dtype=dtype)
    assert paged_kernels.resolve_backend("auto", probe, head_dim, group) == expected
    assert paged_kernels.resolve_backend("auto", probe) == ("torch" if dtype == torch.float64 else "cupy")
    if expected == "torch":
        with pytest.raises(ValueError, match="cupy"):
            paged_kernels.resolve_backend("cupy", probe, head_dim, group)


def test_auto_avoids_misaligned_caches(launches):
    query, kc, vc, tables, lens = decode_inputs(dtype=torch.float16)
    flat = torch.zeros(kc.numel() + 1, dtype=torch.float16)
    shifted = flat[1:].view(kc.shape)  # contiguous, but 2 bytes past a 16-byte boundary
    assert paged_kernels.resolve_backend("auto", query, 128, 2, (shifted, vc)) == "torch"
    with pytest.raises(ValueError, match="aligned"):
        cupy_backend.paged_attention_decode(query, shifted, vc, tables, lens, 0.1)


def test_backend_validates_what_it_is_given(launches):
    query, kc, vc, tables, lens = decode_inputs(dtype=torch.float16)
    with pytest.raises(ValueError, match="dtype"):
        cupy_backend.paged_attention_decode(query, kc.float(), vc.float(), tables, lens, 0.1)
    with pytest.raises(ValueError, match="not divisible"):
        cupy_backend.paged_attention_decode(query[:, :3], kc, vc, tables, lens, 0.1)
    with pytest.raises(ValueError, match="contiguous"):
        cupy_backend.paged_attention_decode(query, kc.transpose(1, 2).contiguous().transpose(1, 2), vc, tables,
                                            lens, 0.1)
    with pytest.raises(ValueError, match="slot_mapping has"):
        cupy_backend.write_kv_cache(query[:, :2], query[:, :2], kc, vc, torch.tensor([0]))
    assert launches == []


def test_empty_batch_and_empty_sequences(launches):
    query, kc, vc, tables, lens = decode_inputs(num_seqs=0, dtype=torch.float16)
    assert cupy_backend.paged_attention_decode(query, kc, vc, tables, lens, 0.1).shape == query.shape
    assert launches == []
    query, kc, vc, tables, lens = decode_inputs(num_seqs=2, dtype=torch.float16)
    cupy_backend.paged_attention_decode(query, kc, vc, tables, torch.zeros(2, dtype=torch.int32), 0.1)
    assert launches[0].grid == (2, 2, 1) and int(launches[0].args[13]) == 0  # v1 writes the zeros


# ---- the compiled code, from nvcc/ptxas (no GPU needed) ------------------------------------------------------------
from tests.cuda_build import attention_symbol, compile_ptx, ptx_entries, ptxas_report  # noqa: E402


def entries_for(ptx_or_report, cuda_type, head_dim, group):
    prefix = attention_symbol(cuda_type, head_dim, group, cupy_backend.NUM_WARPS)
    matches = {name: body for name, body in ptx_or_report.items() if name.startswith(prefix)}
    assert len(matches) == 1, prefix
    return next(iter(matches.values()))


def test_every_instance_compiles_for_sm90():
    assert len(ptx_entries(compile_ptx("90"))) == len(cupy_backend.all_kernel_names())


@pytest.mark.parametrize("cuda_type", ["half_t", "bf16_t"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 8])
def test_attention_reads_kv_with_128_bit_loads(cuda_type, head_dim, group):
    body = entries_for(ptx_entries(compile_ptx("90")), cuda_type, head_dim, group)
    assert body.count("ld.global.nc.v4.u32") >= 2  # K and V
    assert "ld.global.nc.u16" not in body.split("ld.global.nc.v4.u32")[1]  # no scalar K/V loads in the loop


def test_no_instance_spills():
    report = ptxas_report("90")
    assert len(report) == len(cupy_backend.all_kernel_names())
    spilling = {name: r for name, r in report.items() if r["spill_stores"] or r["spill_loads"]}
    assert not spilling


def test_qwen3_06b_configuration_fits_128_registers():
    assert entries_for(ptxas_report("90"), "bf16_t", 128, 2)["registers"] <= 128


def test_launch_passes_tensors_as_device_addresses(monkeypatch):
    """What reaches the CuPy kernel: each tensor's address as a Python int (CuPy passes it as a 64-bit value), bf16
    included, scalars unchanged, on torch's current stream of the tensors' device."""
    import contextlib
    import types

    import cupy

    entered, calls = [], []
    monkeypatch.setattr(cupy.cuda, "Device", lambda index: entered.append(("device", index)) or contextlib.nullcontext())
    monkeypatch.setattr(cupy.cuda, "ExternalStream",
                        lambda pointer: entered.append(("stream", pointer)) or contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: types.SimpleNamespace(cuda_stream=1234))
    bf16, table = torch.zeros(4, 8, dtype=torch.bfloat16), torch.arange(6, dtype=torch.int32)[2:]
    cupy_backend._launch(lambda grid, block, args, shared_mem: calls.append((grid, block, args, shared_mem)),
                         (3, 2), (64,), (bf16, table, np.float32(0.5), np.int32(7)), torch.device("cuda", 1), 96)
    ((grid, block, args, shared_mem),) = calls
    assert (grid, block, shared_mem) == ((3, 2), (64,), 96) and entered == [("device", 1), ("stream", 1234)]
    assert args[:2] == (bf16.data_ptr(), table.data_ptr()) and all(type(a) is int for a in args[:2])
    assert table.data_ptr() == table.untyped_storage().data_ptr() + 2 * 4  # a view's address includes its offset
    assert args[2:] == (np.float32(0.5), np.int32(7)) and type(args[3]) is np.int32


def test_launch_stream_uses_the_cuda_stream_protocol_without_deprecation():
    """A torch stream with ``__cuda_stream__`` reaches CuPy through ``Stream.from_external`` (CuPy 14 deprecates
    ``ExternalStream``) on the same address, as a stream CuPy does not own; one without the protocol, or with a protocol
    version this CuPy does not read, still goes by its address."""
    import types
    import warnings

    import cupy

    class ProtocolStream:
        cuda_stream = 1234

        def __cuda_stream__(self):
            return 0, 1234

    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        stream = cupy_backend._cupy_stream(ProtocolStream())
    assert stream.ptr == 1234 and not isinstance(stream, cupy.cuda.ExternalStream)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert cupy_backend._cupy_stream(types.SimpleNamespace(cuda_stream=1234)).ptr == 1234

    class FutureProtocolStream(ProtocolStream):
        def __cuda_stream__(self):
            return 1, 1234

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert cupy_backend._cupy_stream(FutureProtocolStream()).ptr == 1234


def test_each_kernel_is_looked_up_once(monkeypatch):
    """``RawModule.get_function`` builds a kernel object and asks the driver for the function on every call: the
    launcher keeps what it returns, one per template instance."""
    lookups = []

    class Module:
        def get_function(self, name):
            lookups.append(name)
            return f"kernel {name}"

    monkeypatch.setattr(cupy_backend, "_module", lambda dtype, head_dim, group: Module())
    cupy_backend._kernel.cache_clear()
    try:
        for _ in range(3):
            kernel = cupy_backend._kernel("copy_blocks_kernel<float>", torch.float32)
            assert kernel == "kernel copy_blocks_kernel<float>"
            cupy_backend._kernel("write_kv_cache_kernel<float>", torch.float32)
    finally:
        cupy_backend._kernel.cache_clear()  # no stand-in kernel outlives the test
    assert lookups == ["copy_blocks_kernel<float>", "write_kv_cache_kernel<float>"]
