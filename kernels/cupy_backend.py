"""CuPy backend: the CUDA kernels of ``csrc/paged_attention.cu`` on torch CUDA tensors, zero-copy through DLPack,
launched on torch's current stream."""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

SOURCE_PATH = Path(__file__).parent / "csrc" / "paged_attention.cu"
SUPPORTED_HEAD_DIMS = (64, 128, 256)
MAX_GROUP = 8
NUM_WARPS = 4
PARTITION_SIZE = 512
CUDA_TYPES = {torch.float32: "float", torch.float16: "half_t", torch.bfloat16: "bf16_t"}


def cupy_status() -> tuple[bool, str]:
    """``(usable, reason)``: whether CuPy can run kernels here, and why not when it cannot."""
    try:
        import cupy
    except ImportError as exc:
        return False, f"cupy is not installed ({exc})"
    try:
        if not cupy.cuda.is_available():
            return False, "cupy is installed but no CUDA GPU is visible"
    except Exception as exc:  # driver missing or broken
        return False, f"cupy cannot reach a CUDA driver ({exc})"
    if not torch.cuda.is_available():
        return False, "torch has no CUDA device (the kernels take torch CUDA tensors)"
    return True, "ok"


def check_supported(query_or_cache, head_dim: int, group: int = 1) -> None:
    """Raise ``ValueError`` naming what the CUDA kernels do not support."""
    if query_or_cache.dtype not in CUDA_TYPES:
        raise ValueError(f"cupy backend supports float32/float16/bfloat16, got dtype {query_or_cache.dtype}")
    if not query_or_cache.is_cuda:
        raise ValueError("cupy backend needs CUDA tensors; got a tensor on the CPU")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"cupy backend supports head_dim in {SUPPORTED_HEAD_DIMS}, got {head_dim}")
    if group > MAX_GROUP:
        raise ValueError(f"cupy backend supports up to {MAX_GROUP} query heads per kv head, got {group}")


def attention_kernel_name(dtype: torch.dtype, head_dim: int, group: int) -> str:
    return f"paged_attention_kernel<{CUDA_TYPES[dtype]},{head_dim},{group},{NUM_WARPS}>"


def kernel_names(dtype: torch.dtype, head_dim: int, group: int) -> list[str]:
    """Every template instance one configuration launches."""
    cuda_type = CUDA_TYPES[dtype]
    return [f"write_kv_cache_kernel<{cuda_type}>", f"copy_blocks_kernel<{cuda_type}>",
            attention_kernel_name(dtype, head_dim, group), f"reduce_partitions_kernel<{cuda_type},{head_dim}>"]


def all_kernel_names() -> list[str]:
    """Every template instance the dispatcher can choose (what CI compile-checks)."""
    names = {n for dtype in CUDA_TYPES for d in SUPPORTED_HEAD_DIMS for g in range(1, MAX_GROUP + 1)
             for n in kernel_names(dtype, d, g)}
    return sorted(names)


@functools.lru_cache(maxsize=None)
def _module(dtype: torch.dtype, head_dim: int, group: int):
    import cupy

    return cupy.RawModule(code=SOURCE_PATH.read_text(), options=("--std=c++17",),
                          name_expressions=kernel_names(dtype, head_dim, group))


def _kernel(name: str, dtype: torch.dtype, head_dim: int = 64, group: int = 1):
    return _module(dtype, head_dim, group).get_function(name)


def _as_cupy(tensor: torch.Tensor):
    import cupy

    if tensor.dtype in (torch.bfloat16, torch.float16):
        tensor = tensor.view(torch.int16)  # cupy has no bfloat16; the kernel only sees the pointer
    return cupy.from_dlpack(tensor.detach())


def _launch(kernel, grid, block, args, device: torch.device) -> None:
    import cupy

    stream = torch.cuda.current_stream(device)
    with cupy.cuda.Device(device.index), cupy.cuda.ExternalStream(stream.cuda_stream):
        kernel(grid, block, tuple(_as_cupy(a) if isinstance(a, torch.Tensor) else a for a in args))


def write_kv_cache(key, value, key_cache, value_cache, slot_mapping) -> None:
    """Launch ``write_kv_cache_kernel``: one thread block per token."""
    num_tokens = key.shape[0]
    _, num_kv_heads, block_size, head_dim = key_cache.shape
    check_supported(key_cache, head_dim)
    if num_tokens == 0:
        return
    slots = slot_mapping.to(device=key_cache.device, dtype=torch.int64).contiguous()
    name = f"write_kv_cache_kernel<{CUDA_TYPES[key_cache.dtype]}>"
    threads = min(1024, max(32, num_kv_heads * head_dim))
    _launch(_kernel(name, key_cache.dtype, head_dim), (num_tokens,), (threads,),
            (key.contiguous(), value.contiguous(), key_cache, value_cache, slots, np.int32(num_kv_heads),
             np.int32(head_dim), np.int32(block_size)), key_cache.device)


def copy_blocks(key_cache, value_cache, block_mapping) -> None:
    """Launch ``copy_blocks_kernel``: one thread block per (src, dst) pair."""
    if len(block_mapping) == 0:
        return
    check_supported(key_cache, key_cache.shape[-1])
    mapping = torch.as_tensor(block_mapping, dtype=torch.int64).reshape(-1, 2).to(key_cache.device).contiguous()
    name = f"copy_blocks_kernel<{CUDA_TYPES[key_cache.dtype]}>"
    _launch(_kernel(name, key_cache.dtype, key_cache.shape[-1]), (mapping.shape[0],), (256,),
            (key_cache, value_cache, mapping, np.int64(key_cache[0].numel())), key_cache.device)


def choose_partition_size(num_seqs: int, num_kv_heads: int, max_seq_len: int, sm_count: int) -> int:
    """0 (v1, one thread block per sequence and kv head) unless the context is long and the grid would leave SMs
    idle; then ``PARTITION_SIZE`` (v2, split-K)."""
    if max_seq_len <= PARTITION_SIZE:
        return 0
    if max_seq_len <= 8192 and num_seqs * num_kv_heads >= 4 * sm_count:
        return 0
    return PARTITION_SIZE


def paged_attention_decode(query, key_cache, value_cache, block_tables, seq_lens, scale: float,
                           partition_size: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention with the v1 or v2 kernel (``partition_size``: None chooses, 0 forces v1, >0 forces v2)."""
    num_seqs, num_q_heads, head_dim = query.shape
    _, num_kv_heads, block_size, _ = key_cache.shape
    group = num_q_heads // num_kv_heads
    check_supported(query, head_dim, group)
    device = query.device
    if out is None or not out.is_contiguous():
        out = torch.empty_like(query)  # the kernels write a dense [num_seqs, num_q_heads, head_dim]
    if num_seqs == 0:
        return out
    block_tables = block_tables.to(device=device, dtype=torch.int32).contiguous()
    seq_lens = seq_lens.to(device=device, dtype=torch.int32).contiguous()
    max_seq_len = int(seq_lens.max())
    if partition_size is None:
        sm_count = torch.cuda.get_device_properties(device).multi_processor_count
        partition_size = choose_partition_size(num_seqs, num_kv_heads, max_seq_len, sm_count)
    num_parts = -(-max_seq_len // partition_size) if partition_size else 1
    max_logits = torch.empty((num_seqs, num_q_heads, num_parts), dtype=torch.float32, device=device)
    exp_sums = torch.empty_like(max_logits)
    partial_out = torch.empty((num_seqs, num_q_heads, num_parts, head_dim), dtype=torch.float32, device=device)
    _launch(_kernel(attention_kernel_name(query.dtype, head_dim, group), query.dtype, head_dim, group),
            (num_kv_heads, num_seqs, num_parts), (NUM_WARPS * 32,),
            (out, max_logits, exp_sums, partial_out, query.contiguous(), key_cache, value_cache, block_tables,
             seq_lens, np.float32(scale), np.int32(num_kv_heads), np.int32(block_size),
             np.int32(block_tables.shape[1]), np.int32(partition_size), np.int32(num_parts)), device)
    if partition_size:
        name = f"reduce_partitions_kernel<{CUDA_TYPES[query.dtype]},{head_dim}>"
        _launch(_kernel(name, query.dtype, head_dim, group), (num_q_heads, num_seqs), (min(head_dim, 128),),
                (out, max_logits, exp_sums, partial_out, seq_lens, np.int32(partition_size), np.int32(num_parts)),
                device)
    return out


def instantiation_source() -> str:
    """The CUDA source plus host references to every template instance, so an offline nvcc compile (which has
    no name expressions) instantiates and checks all of them."""
    refs = ",\n  ".join(f"(const void*)&{name}" for name in all_kernel_names())
    return f"{SOURCE_PATH.read_text()}\nconst void* minipaged_all_kernels[] = {{\n  {refs}\n}};\n"
