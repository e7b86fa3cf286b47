"""CuPy backend: the CUDA kernels of ``csrc/paged_attention.cu`` on torch CUDA tensors, zero-copy through DLPack,
launched on torch's current stream.

Every function here checks the shapes, dtypes and devices it is given (nothing that needs a device sync); the
data-dependent checks (slots and block ids in range) are the public API's ``check=True``. Launch geometry goes
through ``_launch`` only, so tests can record it on a machine without a GPU.
"""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

from . import fp8, validate
from .validate import KernelArgumentError, is_cuda

CSRC = Path(__file__).parent / "csrc"
SOURCE_PATH = CSRC / "paged_attention.cu"
FUSED_SOURCE_PATH = CSRC / "fused_ops.cu"
COMMON_PATH = CSRC / "common.cuh"  # prepended to each source: the 16-bit types and conversions
SUPPORTED_HEAD_DIMS = (64, 128, 256)
MAX_GROUP = 8
NUM_WARPS = 4
PARTITION_SIZE = 512
MAX_GRID_YZ = 65_535  # CUDA's limit on gridDim.y and gridDim.z
VECTOR_BYTES = 16  # the attention kernel reads K/V in 16-byte chunks, so the caches must be 16-byte aligned
CUDA_TYPES = {torch.float32: "float", torch.float16: "half_t", torch.bfloat16: "bf16_t"}
# FP8 caches (uint8 tensors of codes): the CUDA element type of each format, a template argument of the kernels that
# write or read a cache (csrc/common.cuh); block copies move their bytes (BYTE_TYPE)
FP8_CUDA_TYPES = {"e4m3": "fp8_e4m3_t", "e5m2": "fp8_e5m2_t"}
FP8_CACHE_DTYPES = ("fp8_e4m3", "fp8_e5m2")  # one of each format ("fp8" is fp8_e4m3's alias)
BYTE_TYPE = "unsigned char"


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


def unsupported_reason(tensor, head_dim: int | None = None, group: int = 1, caches=(),
                       kv_cache_dtype: str | None = None) -> str | None:
    """Why the CUDA kernels cannot run on ``tensor`` (None when they can). ``head_dim`` is given for attention, whose
    kernel is instantiated for ``SUPPORTED_HEAD_DIMS`` and up to ``MAX_GROUP`` q heads per kv head and reads the
    ``caches`` with 16-byte loads; the cache-write and block-copy kernels take any head_dim. ``tensor`` may be a
    ``uint8`` cache (FP8 codes: written, copied, swapped); ``caches`` of ``uint8`` are FP8 caches, read with the
    ``kv_cache_dtype`` given (when given, it must name FP8 for ``uint8`` caches and ``auto`` for the others)."""
    if tensor.dtype not in CUDA_TYPES and tensor.dtype != torch.uint8:
        return f"the cupy backend supports float32/float16/bfloat16 (and uint8 FP8 caches), got dtype {tensor.dtype}"
    if not is_cuda(tensor):
        return "the cupy backend needs CUDA tensors; got a tensor on the CPU"
    if kv_cache_dtype is not None:
        stores_bytes = any(c.dtype == torch.uint8 for c in (tensor, *caches))
        if stores_bytes != fp8.is_fp8(kv_cache_dtype):
            return (f"kv_cache_dtype={kv_cache_dtype!r} does not match the caches' dtype "
                    f"({'uint8' if stores_bytes else 'floating point'})")
    if head_dim is None:
        return None
    if head_dim not in SUPPORTED_HEAD_DIMS:
        return f"the cupy attention kernel supports head_dim in {SUPPORTED_HEAD_DIMS}, got {head_dim}"
    if group > MAX_GROUP:
        return f"the cupy attention kernel supports up to {MAX_GROUP} query heads per kv head, got {group}"
    misaligned = [c for c in caches if c.data_ptr() % VECTOR_BYTES]
    if misaligned:
        return f"the cupy attention kernel needs {VECTOR_BYTES}-byte aligned caches (a view at an offset is not)"
    return None


def _cache_argument(kv_cache_dtype: str) -> str:
    """The trailing template argument naming the cache element type: none for ``auto`` (the default, the model's
    type), ``,fp8_e4m3_t`` or ``,fp8_e5m2_t`` for an FP8 ``kv_cache_dtype``."""
    return f",{FP8_CUDA_TYPES[fp8.fp8_format(kv_cache_dtype)]}" if fp8.is_fp8(kv_cache_dtype) else ""


def attention_kernel_name(dtype: torch.dtype, head_dim: int, group: int, kv_cache_dtype: str = "auto") -> str:
    return (f"paged_attention_kernel<{CUDA_TYPES[dtype]},{head_dim},{group},{NUM_WARPS}"
            f"{_cache_argument(kv_cache_dtype)}>")


def write_kernel_name(dtype: torch.dtype, kv_cache_dtype: str = "auto") -> str:
    return f"write_kv_cache_kernel<{CUDA_TYPES[dtype]}{_cache_argument(kv_cache_dtype)}>"


def copy_kernel_name(cache_dtype: torch.dtype) -> str:
    """The block copy for caches of ``cache_dtype`` (``uint8``: FP8 codes, copied as bytes)."""
    return f"copy_blocks_kernel<{BYTE_TYPE if cache_dtype == torch.uint8 else CUDA_TYPES[cache_dtype]}>"


def kernel_names(dtype: torch.dtype, head_dim: int, group: int, kv_cache_dtype: str = "auto") -> list[str]:
    """Every template instance one configuration launches (``dtype`` the model's; ``torch.uint8``: the byte copy that
    FP8 caches use, the only kernel that does not depend on the model's dtype)."""
    if dtype == torch.uint8:
        return [copy_kernel_name(dtype)]
    names = [write_kernel_name(dtype, kv_cache_dtype), attention_kernel_name(dtype, head_dim, group, kv_cache_dtype),
             f"reduce_partitions_kernel<{CUDA_TYPES[dtype]},{head_dim}>"]
    return names if fp8.is_fp8(kv_cache_dtype) else [names[0], copy_kernel_name(dtype), *names[1:]]


FUSED_KERNELS = ("rms_norm_kernel", "silu_and_mul_kernel", "qk_norm_rope_write_kernel")


def fused_kernel_names(dtype: torch.dtype, kv_cache_dtype: str = "auto") -> list[str]:
    """The fused layer ops' instances for one dtype (``csrc/fused_ops.cu``); for an FP8 ``kv_cache_dtype`` only the
    one that writes the caches, ``qk_norm_rope_write_kernel<T,fp8_*_t>``."""
    if fp8.is_fp8(kv_cache_dtype):
        return [f"qk_norm_rope_write_kernel<{CUDA_TYPES[dtype]}{_cache_argument(kv_cache_dtype)}>"]
    return [f"{name}<{CUDA_TYPES[dtype]}>" for name in FUSED_KERNELS]


def all_kernel_names() -> list[str]:
    """Every template instance the dispatcher can choose (what CI compile-checks), FP8 caches' included."""
    precisions = ("auto", *FP8_CACHE_DTYPES)
    names = {n for dtype in CUDA_TYPES for d in SUPPORTED_HEAD_DIMS for g in range(1, MAX_GROUP + 1)
             for p in precisions for n in kernel_names(dtype, d, g, p)}
    names |= {n for dtype in CUDA_TYPES for p in precisions for n in fused_kernel_names(dtype, p)}
    return sorted(names | set(kernel_names(torch.uint8, 0, 1)))


def source(path: Path) -> str:
    """A kernel source as compiled: ``common.cuh``, then the file."""
    return f"{COMMON_PATH.read_text()}\n{path.read_text()}"


def attention_shared_bytes(head_dim: int, group: int) -> int:
    """Dynamic shared memory of the attention kernel: warps 1.. each leave GROUP accumulators and (m, l) pairs."""
    return (NUM_WARPS - 1) * group * (head_dim + 2) * 4


@functools.lru_cache(maxsize=None)
def _module(dtype: torch.dtype, head_dim: int, group: int, kv_cache_dtype: str = "auto"):
    import cupy

    return cupy.RawModule(code=source(SOURCE_PATH), options=("--std=c++17",),
                          name_expressions=kernel_names(dtype, head_dim, group, kv_cache_dtype))


@functools.lru_cache(maxsize=None)
def _fused_module(dtype: torch.dtype, kv_cache_dtype: str = "auto"):
    import cupy

    return cupy.RawModule(code=source(FUSED_SOURCE_PATH), options=("--std=c++17",),
                          name_expressions=fused_kernel_names(dtype, kv_cache_dtype))


@functools.lru_cache(maxsize=None)
def _kernel(name: str, dtype: torch.dtype, head_dim: int = 64, group: int = 1, kv_cache_dtype: str = "auto"):
    """The kernel ``name`` of its module, kept: CuPy's ``RawModule.get_function`` builds a new kernel object and looks
    the function up in the driver (``cuModuleGetFunction``) every time it is called, and a decode step launches about
    three kernels per layer. (The kernel object compiles and caches per device itself.) ``kv_cache_dtype``: which
    module holds FP8 instances (``dtype`` ``torch.uint8``: the byte copy's)."""
    if fp8.is_fp8(kv_cache_dtype):  # one module per format: "fp8" is "fp8_e4m3"
        kv_cache_dtype = f"fp8_{fp8.fp8_format(kv_cache_dtype)}"
    if name.startswith(FUSED_KERNELS):
        return _fused_module(dtype, kv_cache_dtype).get_function(name)
    if kv_cache_dtype == "auto":
        return _module(dtype, head_dim, group).get_function(name)
    return _module(dtype, head_dim, group, kv_cache_dtype).get_function(name)


def _launch(kernel, grid, block, args, device: torch.device, shared_mem: int = 0) -> None:
    """Launch on torch's current stream. Tensors go in as their device addresses: CuPy passes a Python int as a
    64-bit value, a pointer's size, where a DLPack view per tensor made a CuPy array object every launch (bf16 needs
    no int16 view either: the kernel only sees the pointer). Callers pass contiguous tensors on ``device``."""
    import cupy

    with cupy.cuda.Device(device.index), _cupy_stream(torch.cuda.current_stream(device)):
        kernel(grid, block, tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args),
               shared_mem=shared_mem)


def _cupy_stream(stream):
    """CuPy's view of a torch CUDA stream: through the CUDA stream protocol where both sides have it (CuPy 14
    deprecates ``ExternalStream``; recent torch streams have ``__cuda_stream__``), else by its address (CuPy 13)."""
    import cupy

    if hasattr(cupy.cuda.Stream, "from_external") and hasattr(stream, "__cuda_stream__"):
        try:
            return cupy.cuda.Stream.from_external(stream)
        except TypeError:  # a protocol version this CuPy does not read
            pass
    return cupy.cuda.ExternalStream(stream.cuda_stream)


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _require(reason: str | None) -> None:
    if reason is not None:
        raise KernelArgumentError(reason)


def _scales(kv_cache_dtype: str, k_scale: float, v_scale: float) -> tuple[np.float32, np.float32]:
    """The kernels' ``k_scale, v_scale`` arguments (float32, as fp8.quantize divides; 1 for ``auto`` caches, which
    ignore them)."""
    if not fp8.is_fp8(kv_cache_dtype):
        return np.float32(1.0), np.float32(1.0)
    return np.float32(fp8.check_kv_scale("k_scale", k_scale)), np.float32(fp8.check_kv_scale("v_scale", v_scale))


def write_kv_cache(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype: str = "auto",
                   k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Launch ``write_kv_cache_kernel``: one thread block per token. Non-negative slots must be distinct (the
    public API checks it with ``check=True``); the block manager gives every (sequence, position) its own slot. An
    FP8 ``kv_cache_dtype`` writes the codes of ``key / k_scale`` and ``value / v_scale`` into ``uint8`` caches."""
    validate.check_write_shapes(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype)
    _require(unsupported_reason(key_cache, kv_cache_dtype=kv_cache_dtype) or unsupported_reason(key))
    _require_contiguous(key_cache, value_cache)
    num_tokens = key.shape[0]
    _, num_kv_heads, block_size, head_dim = key_cache.shape
    if num_tokens == 0:
        return
    slots = slot_mapping.to(device=key_cache.device, dtype=torch.int64).contiguous()
    name = write_kernel_name(key.dtype, kv_cache_dtype)
    threads = min(1024, max(32, num_kv_heads * head_dim))
    _launch(_kernel(name, key.dtype, 64, 1, kv_cache_dtype), (num_tokens,), (threads,),
            (key.contiguous(), value.contiguous(), key_cache, value_cache, slots, np.int32(num_kv_heads),
             np.int32(head_dim), np.int32(block_size), *_scales(kv_cache_dtype, k_scale, v_scale)), key_cache.device)


def copy_rounds(block_mapping: np.ndarray) -> list[np.ndarray]:
    """Split ``(src, dst)`` pairs, in order, into consecutive rounds whose pairs are independent (no pair reads or
    writes a block an earlier pair of the same round writes, nor writes one it reads), so running each round in
    parallel and the rounds one after another equals running the pairs one by one."""
    rounds, current, written, read = [], [], set(), set()
    for src, dst in np.asarray(block_mapping, dtype=np.int64).reshape(-1, 2).tolist():
        if src in written or dst in written or dst in read:
            rounds.append(np.array(current, dtype=np.int64))
            current, written, read = [], set(), set()
        current.append((src, dst))
        written.add(dst)
        read.add(src)
    if current:
        rounds.append(np.array(current, dtype=np.int64))
    return rounds


def copy_blocks(key_cache, value_cache, block_mapping) -> None:
    """Launch ``copy_blocks_kernel`` (one thread block per (src, dst) pair) once per independent round, so the
    pairs take effect in order like the other backends' loops."""
    validate.check_cache_pair(key_cache, value_cache, None)
    _require(unsupported_reason(key_cache))
    _require_contiguous(key_cache, value_cache)
    name = copy_kernel_name(key_cache.dtype)
    for pairs in copy_rounds(validate.to_numpy(block_mapping)):
        mapping = torch.from_numpy(pairs).to(key_cache.device)
        _launch(_kernel(name, key_cache.dtype), (len(pairs),), (256,),
                (key_cache, value_cache, mapping, np.int64(key_cache[0].numel())), key_cache.device)


def swap_blocks(src_key_cache, src_value_cache, dst_key_cache, dst_value_cache, block_mapping) -> None:
    """One ``cudaMemcpyAsync`` per block and cache on torch's current stream (device <-> pinned host, or within a
    device), as vLLM swaps. The caches must be contiguous; the mapping's destinations distinct (checked)."""
    import cupy

    for cache in (src_key_cache, src_value_cache, dst_key_cache, dst_value_cache):
        if not cache.is_contiguous():
            raise KernelArgumentError("the cupy backend needs contiguous caches to swap blocks")
    mapping = validate.to_numpy(block_mapping).reshape(-1, 2)
    device = src_key_cache.device if is_cuda(src_key_cache) else dst_key_cache.device
    block_bytes = src_key_cache[0].numel() * src_key_cache.element_size()
    stream = torch.cuda.current_stream(device).cuda_stream
    default_kind = 4  # cudaMemcpyDefault: direction from unified virtual addresses
    for src, dst in ((src_key_cache, dst_key_cache), (src_value_cache, dst_value_cache)):
        for s, d in mapping.tolist():
            cupy.cuda.runtime.memcpyAsync(dst.data_ptr() + d * block_bytes, src.data_ptr() + s * block_bytes,
                                          block_bytes, default_kind, stream)


def choose_partition_size(num_seqs: int, num_kv_heads: int, max_seq_len: int, sm_count: int) -> int:
    """0 (v1, one thread block per sequence and kv head) unless the context is long and the grid would leave SMs
    idle; then ``PARTITION_SIZE`` (v2, split-K), or a multiple of it when that many partitions would pass the
    grid's z limit."""
    if max_seq_len <= PARTITION_SIZE:
        return 0
    if max_seq_len <= 8192 and num_seqs * num_kv_heads >= 4 * sm_count:
        return 0
    return PARTITION_SIZE * -(-max_seq_len // (PARTITION_SIZE * MAX_GRID_YZ))


def paged_attention_decode(query, key_cache, value_cache, block_tables, seq_lens, scale: float,
                           partition_size: int | None = None, out: torch.Tensor | None = None,
                           max_seq_len: int | None = None, kv_cache_dtype: str = "auto", k_scale: float = 1.0,
                           v_scale: float = 1.0) -> torch.Tensor:
    """Decode attention with the v1 or v2 kernel (``partition_size``: None chooses, 0 forces v1, >0 forces v2).
    Sequences of length 0 get zeros. ``out`` may have any strides: the kernel writes a dense buffer that is then
    copied into it. ``max_seq_len``: the longest of ``seq_lens`` if known (else read from them: a device sync).
    An FP8 ``kv_cache_dtype``: the ``uint8`` caches' codes are read as ``value * k_scale`` / ``value * v_scale``."""
    validate.check_attention_shapes(query, key_cache, value_cache, block_tables, seq_lens, kv_cache_dtype)
    if out is not None:
        validate.check_out(out, query)
    num_seqs, num_q_heads, head_dim = query.shape
    _, num_kv_heads, block_size, _ = key_cache.shape
    group = num_q_heads // num_kv_heads
    _require(unsupported_reason(query, head_dim, group, (key_cache, value_cache), kv_cache_dtype))
    if query.dtype == torch.uint8:
        raise KernelArgumentError("the query must be float32/float16/bfloat16, got uint8")
    scales = _scales(kv_cache_dtype, k_scale, v_scale)
    _require_contiguous(key_cache, value_cache)
    device = query.device
    dense = out if out is not None and out.is_contiguous() else torch.empty(query.shape, dtype=query.dtype,
                                                                           device=device)
    if num_seqs:
        _attend(dense, query.contiguous(), key_cache, value_cache, block_tables, seq_lens, scale, partition_size,
                max_seq_len, kv_cache_dtype, scales)
    if out is not None and dense is not out:
        out.copy_(dense)
        return out
    return dense


def _attend(out, query, key_cache, value_cache, block_tables, seq_lens, scale, partition_size, max_seq_len,
            kv_cache_dtype="auto", scales=None) -> None:
    num_seqs, num_q_heads, head_dim = query.shape
    _, num_kv_heads, block_size, _ = key_cache.shape
    group, device = num_q_heads // num_kv_heads, query.device
    block_tables = block_tables.to(device=device, dtype=torch.int32).contiguous()
    seq_lens = seq_lens.to(device=device, dtype=torch.int32).contiguous()
    max_seq_len = int(seq_lens.max()) if max_seq_len is None else int(max_seq_len)
    if partition_size is None:
        partition_size = choose_partition_size(num_seqs, num_kv_heads, max_seq_len, _sm_count(device))
    num_parts = max(1, -(-max_seq_len // partition_size)) if partition_size else 1
    if num_parts > MAX_GRID_YZ:
        raise KernelArgumentError(f"partition_size={partition_size} splits a {max_seq_len}-token context into {num_parts} "
                         f"partitions; the grid allows {MAX_GRID_YZ}")
    max_logits = torch.empty((num_seqs, num_q_heads, num_parts), dtype=torch.float32, device=device)
    exp_sums = torch.empty_like(max_logits)
    partial_out = torch.empty((num_seqs, num_q_heads, num_parts, head_dim), dtype=torch.float32, device=device)
    scales = _scales("auto", 1.0, 1.0) if scales is None else scales
    attention = _kernel(attention_kernel_name(query.dtype, head_dim, group, kv_cache_dtype), query.dtype, head_dim,
                        group, kv_cache_dtype)
    reduce = partition_size and _kernel(f"reduce_partitions_kernel<{CUDA_TYPES[query.dtype]},{head_dim}>",
                                        query.dtype, head_dim, group, kv_cache_dtype)
    shared = attention_shared_bytes(head_dim, group)
    for first in range(0, num_seqs, MAX_GRID_YZ):  # tile the sequences over launches: gridDim.y <= 65,535
        count = min(MAX_GRID_YZ, num_seqs - first)
        _launch(attention, (num_kv_heads, count, num_parts), (NUM_WARPS * 32,),
                (out, max_logits, exp_sums, partial_out, query, key_cache, value_cache, block_tables, seq_lens,
                 np.float32(scale), np.int32(num_kv_heads), np.int32(block_size), np.int32(block_tables.shape[1]),
                 np.int32(partition_size), np.int32(num_parts), np.int32(first), *scales), device,
                shared_mem=shared)
        if partition_size:
            _launch(reduce, (num_q_heads, count), (min(head_dim, 128),),
                    (out, max_logits, exp_sums, partial_out, seq_lens, np.int32(partition_size), np.int32(num_parts),
                     np.int32(first)), device)


def _require_contiguous(key_cache, value_cache) -> None:
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise KernelArgumentError("the cupy backend needs contiguous key_cache and value_cache")


def instantiation_source() -> str:
    """Every CUDA source plus host references to every template instance, so an offline nvcc compile (which has
    no name expressions) instantiates and checks all of them."""
    refs = ",\n  ".join(f"(const void*)&{name}" for name in all_kernel_names())
    return (f"{source(SOURCE_PATH)}\n{FUSED_SOURCE_PATH.read_text()}\n"
            f"const void* minipaged_all_kernels[] = {{\n  {refs}\n}};\n")


# ---- fused layer ops ---------------------------------------------------------------------------------------------
def _row_threads(width: int) -> int:
    """Threads of a one-block-per-row kernel: whole warps (the block reduction needs them), at most 1024."""
    return min(1024, max(32, -(-width // 32) * 32))


def rms_norm(x, weight, eps: float, residual=None):
    """Launch ``rms_norm_kernel`` (one thread block per row); returns new ``(normed, residual_out)``."""
    _require(unsupported_reason(x))
    x = x.contiguous()
    out, residual_out = torch.empty_like(x), torch.empty_like(x)
    hidden = x.shape[-1]
    rows = x.numel() // hidden
    if rows:
        _launch(_kernel(f"rms_norm_kernel<{CUDA_TYPES[x.dtype]}>", x.dtype), (rows,), (_row_threads(hidden),),
                (out, residual_out, x, x if residual is None else residual.contiguous(), weight.contiguous(),
                 np.float32(eps), np.int32(hidden), np.int32(residual is not None)), x.device)
    return out, residual_out


def silu_and_mul(x):
    """Launch ``silu_and_mul_kernel`` (one thread block per row)."""
    _require(unsupported_reason(x))
    x = x.contiguous()
    d = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    rows = out.numel() // d
    if rows:
        _launch(_kernel(f"silu_and_mul_kernel<{CUDA_TYPES[x.dtype]}>", x.dtype), (rows,), (_row_threads(d),),
                (out, x, np.int32(d)), x.device)
    return out


def _token_rows(t):
    """``t [tokens, heads, head_dim]`` with dense heads (a view of a merged projection keeps its row stride)."""
    return t if t.stride(2) == 1 and t.stride(1) == t.shape[2] else t.contiguous()


def qk_norm_rope_write(q, k, v, q_weight, k_weight, cos_sin_cache, positions, key_cache, value_cache, slot_mapping,
                       eps: float, kv_cache_dtype: str = "auto", k_scale: float = 1.0, v_scale: float = 1.0):
    """Launch ``qk_norm_rope_write_kernel``: grid (tokens, q heads + kv heads), ``head_dim / 2`` threads. An FP8
    ``kv_cache_dtype`` writes the codes of the rotated keys / ``k_scale`` and of ``v`` / ``v_scale``."""
    _require(unsupported_reason(key_cache, kv_cache_dtype=kv_cache_dtype) or unsupported_reason(q))
    _require_contiguous(key_cache, value_cache)
    num_tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = key_cache.shape
    q, k, v = _token_rows(q), _token_rows(k), _token_rows(v)
    q_out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((num_tokens, num_kv_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens:
        device = key_cache.device
        index = dict(device=device, dtype=torch.int64)
        _launch(_kernel(fused_kernel_names(q.dtype, kv_cache_dtype)[-1], q.dtype, 64, 1, kv_cache_dtype),
                (num_tokens, num_q_heads + num_kv_heads), (_row_threads(head_dim // 2),),
                (q_out, k_out, q, k, v, q_weight.contiguous(), k_weight.contiguous(), cos_sin_cache.contiguous(),
                 positions.to(**index).contiguous(), key_cache, value_cache, slot_mapping.to(**index).contiguous(),
                 np.float32(eps), np.int32(num_q_heads), np.int32(num_kv_heads), np.int32(head_dim),
                 np.int32(block_size), np.int64(q.stride(0)), np.int64(k.stride(0)), np.int64(v.stride(0)),
                 *_scales(kv_cache_dtype, k_scale, v_scale)), device)
    return q_out, k_out
