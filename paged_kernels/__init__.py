"""Paged KV-cache ops and paged decode attention, one API over three backends.

``reference`` (float64 NumPy, the truth), ``torch`` (CPU and CUDA) and ``cupy`` (CUDA kernels). ``backend="auto"``
picks ``cupy`` for CUDA tensors when CuPy can run that call (dtype, head_dim, GQA group, alignment), else ``torch``
(``reference`` for NumPy arrays).

KV precision (``kv_cache_dtype``, vLLM's names and meaning): ``auto`` caches hold the model's dtype; ``fp8`` /
``fp8_e4m3`` / ``fp8_e5m2`` caches are ``uint8`` tensors of FP8 codes with per-tensor ``k_scale`` / ``v_scale``: the
cache writes quantize (saturating), attention dequantizes on load; ``paged_kernels.fp8`` defines both.

Contracts shared by every backend: negative slots in ``slot_mapping`` are padding and are skipped, non-negative
slots must be distinct; block-table entries past a sequence's blocks are padding (any value, -1 by convention); a
sequence of length 0 attends to nothing and gets zeros; ``copy_blocks`` pairs take effect in order.
"""
from __future__ import annotations

import numpy as np

from . import fp8, reference, validate
from . import cupy_backend as _cupy
from .cupy_backend import cupy_status
from .validate import BackendUnavailableError, KernelArgumentError

BACKENDS = ("reference", "torch", "cupy")

KV_CACHE_DTYPES = fp8.KV_CACHE_DTYPES

__all__ = ["KV_CACHE_DTYPES",
           "write_kv_cache", "paged_attention_decode", "copy_blocks", "swap_blocks", "rms_norm", "silu_and_mul",
           "qk_norm_rope_write", "available_backends", "BACKENDS", "cupy_status", "resolve_backend",
           "KernelArgumentError", "BackendUnavailableError"]


def available_backends() -> list[str]:
    """Backends that can run on this machine."""
    backends = ["reference"]
    try:
        import torch  # noqa: F401
        backends.append("torch")
    except ImportError:
        pass
    if cupy_status()[0]:
        backends.append("cupy")
    return backends


def resolve_backend(backend: str, tensor, head_dim: int | None = None, group: int = 1, caches=()) -> str:
    """The concrete backend for ``backend`` on ``tensor``; raises for unknown or unusable ones. Give ``head_dim``,
    ``group`` and ``caches`` for attention, so ``auto`` only picks ``cupy`` where its kernel is instantiated."""
    if not isinstance(backend, str) or backend not in (*BACKENDS, "auto"):
        raise KernelArgumentError(f"backend must be one of {', '.join((*BACKENDS, 'auto'))}; got {backend!r}")
    is_numpy = isinstance(tensor, np.ndarray)
    if backend == "auto":
        if is_numpy:
            return "reference"
        runnable = _cupy.is_cuda(tensor) and cupy_status()[0] and _cupy.unsupported_reason(tensor, head_dim, group,
                                                                                              caches) is None
        return "cupy" if runnable else "torch"
    if is_numpy and backend != "reference":
        raise KernelArgumentError(f"backend {backend!r} takes torch tensors; NumPy arrays need backend='reference'")
    if backend == "cupy":
        usable, reason = cupy_status()
        if not usable:
            raise BackendUnavailableError(f"backend 'cupy' is unavailable: {reason}")
        if not _cupy.is_cuda(tensor):
            raise KernelArgumentError("backend 'cupy' needs CUDA tensors; got CPU tensors")
        reason = _cupy.unsupported_reason(tensor, head_dim, group, caches)
        if reason is not None:
            raise KernelArgumentError(reason)
        return "cupy"
    return backend


def _check_precision(kv_cache_dtype, k_scale, v_scale) -> tuple[str, float, float]:
    return (fp8.check_kv_cache_dtype(kv_cache_dtype), fp8.check_kv_scale("k_scale", k_scale),
            fp8.check_kv_scale("v_scale", v_scale))


def write_kv_cache(key, value, key_cache, value_cache, slot_mapping, backend: str = "auto", check: bool = True,
                   kv_cache_dtype: str = "auto", k_scale: float = 1.0, v_scale: float = 1.0):
    """Write K/V ``[num_tokens, num_kv_heads, head_dim]`` into the paged caches at ``slot_mapping`` (in place;
    negative slots are skipped). An FP8 ``kv_cache_dtype`` quantizes: ``K * (1 / k_scale)`` and ``V * (1 / v_scale)``
    as FP8 codes, rounded toward zero as vLLM's CPU write rounds, into ``uint8`` caches
    (``paged_kernels.fp8.quantize``)."""
    kv_cache_dtype, k_scale, v_scale = _check_precision(kv_cache_dtype, k_scale, v_scale)
    if check:
        validate.check_write_args(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype)
    else:
        validate.check_write_shapes(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype)
    name = resolve_backend(backend, key_cache, caches=(key_cache, value_cache))
    slot_mapping = validate.index_like(slot_mapping, key_cache)
    module = _backend_module(name)
    if fp8.is_fp8(kv_cache_dtype):
        module.write_kv_cache(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale)
    else:
        module.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)


def copy_blocks(key_cache, value_cache, block_mapping, backend: str = "auto", check: bool = True):
    """Copy whole blocks for each ``(src, dst)`` pair (copy-on-write), in order: a pair may read a block an earlier
    pair wrote. The mapping is host data and is always checked (``check`` is accepted for symmetry)."""
    num_blocks = validate.check_cache_pair(key_cache, value_cache, None)[0]
    mapping = validate.check_block_mapping(block_mapping, num_blocks)
    name = resolve_backend(backend, key_cache)
    module = _backend_module(name)
    if isinstance(key_cache, np.ndarray):
        module.copy_blocks(key_cache, value_cache, mapping)
    else:
        import torch

        module.copy_blocks(key_cache, value_cache, torch.as_tensor(mapping, dtype=torch.int64).reshape(-1, 2))


def swap_blocks(src_key_cache, src_value_cache, dst_key_cache, dst_value_cache, block_mapping,
                backend: str = "auto"):
    """Swap: copy whole blocks ``dst_*[d] = src_*[s]`` for each ``(s, d)`` pair between two cache pairs of the same
    block shape and dtype, typically device <-> host (preemption by swapping). Destinations must be distinct. Checks
    everything before copying anything; a bad mapping raises ``KernelArgumentError`` (a ``ValueError``) and changes nothing."""
    mapping = validate.check_swap_args(src_key_cache, src_value_cache, dst_key_cache, dst_value_cache, block_mapping)
    if isinstance(src_key_cache, np.ndarray) or isinstance(dst_key_cache, np.ndarray):
        if not (isinstance(src_key_cache, np.ndarray) and isinstance(dst_key_cache, np.ndarray)):
            raise KernelArgumentError("swap_blocks takes two NumPy cache pairs or two torch cache pairs, not a mix")
        for src, dst in ((src_key_cache, dst_key_cache), (src_value_cache, dst_value_cache)):
            dst[mapping[:, 1]] = src[mapping[:, 0]]
        return
    import torch

    on_gpu = src_key_cache if src_key_cache.is_cuda else dst_key_cache
    name = resolve_backend("torch" if backend == "reference" else backend, on_gpu)
    module = _backend_module(name)
    module.swap_blocks(src_key_cache, src_value_cache, dst_key_cache, dst_value_cache,
                       mapping if name == "cupy" else torch.from_numpy(mapping))


def paged_attention_decode(query, key_cache, value_cache, block_tables, seq_lens, scale: float | None = None,
                           backend: str = "auto", check: bool = True, out=None, max_seq_len: int | None = None,
                           kv_cache_dtype: str = "auto", k_scale: float = 1.0, v_scale: float = 1.0):
    """One decode step of attention: ``query [num_seqs, num_q_heads, head_dim]`` against each sequence's first
    ``seq_lens[s]`` cached tokens, found through ``block_tables``. GQA maps q head ``h`` to kv head
    ``h // (num_q_heads // num_kv_heads)``; ``scale`` defaults to ``head_dim ** -0.5``. Returns ``out`` like query
    (written into ``out`` when given). ``max_seq_len``: ``max(seq_lens)`` when the caller knows it on the host (a
    runner calls this once per layer with the same lengths): with CUDA tensors, reading it from ``seq_lens`` waits
    for the GPU to finish the work queued so far, every call. An FP8 ``kv_cache_dtype``: the ``uint8`` caches'
    codes are read as ``value * k_scale`` / ``value * v_scale`` (float32 in the kernels, float64 in the reference)."""
    kv_cache_dtype, k_scale, v_scale = _check_precision(kv_cache_dtype, k_scale, v_scale)
    if check:
        validate.check_attention_args(query, key_cache, value_cache, block_tables, seq_lens, kv_cache_dtype)
        validate.check_max_seq_len(max_seq_len, seq_lens)
    else:
        validate.check_attention_shapes(query, key_cache, value_cache, block_tables, seq_lens, kv_cache_dtype)
        validate.check_max_seq_len(max_seq_len)
    if out is not None:
        validate.check_out(out, query)
    scale = validate.check_scale(query.shape[-1] ** -0.5 if scale is None else scale)
    name = resolve_backend(backend, query, query.shape[-1], query.shape[1] // key_cache.shape[1],
                           (key_cache, value_cache))
    quantized = fp8.is_fp8(kv_cache_dtype)
    if name == "reference":
        caches = (validate.to_numpy(key_cache), validate.to_numpy(value_cache)) if quantized else \
            (validate.to_numpy_float(key_cache), validate.to_numpy_float(value_cache))
        result = reference.paged_attention_decode(validate.to_numpy_float(query), *caches,
                                                  validate.to_numpy(block_tables), validate.to_numpy(seq_lens), scale,
                                                  kv_cache_dtype, k_scale, v_scale)
        result = result if isinstance(query, np.ndarray) else _like(result, query)
    else:
        block_tables, seq_lens = validate.index_like(block_tables, key_cache), validate.index_like(seq_lens, key_cache)
        precision = dict(kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale) if quantized else {}
        result = _backend_module(name).paged_attention_decode(query, key_cache, value_cache, block_tables, seq_lens,
                                                              scale, out=out, max_seq_len=max_seq_len, **precision)
    if out is not None and result is not out:
        out[...] = result
        return out
    return result


# ---- the fused ops of a transformer layer (one launch each on the cupy backend) ------------------------------------
def rms_norm(x, weight, eps: float = 1e-6, residual=None, backend: str = "auto"):
    """RMSNorm over the last axis, with the residual add fused in: returns ``(normed, residual_out)`` where
    ``residual_out = x + residual`` (``x`` when ``residual`` is None) and ``normed = residual_out / sqrt(mean(
    residual_out ** 2) + eps) * weight``. A layer calls it twice: before attention (``residual`` = the previous
    layer's) and before the MLP."""
    validate.check_rms_norm_args(x, weight, residual)
    eps = validate.check_eps(eps)
    name = resolve_backend(backend, x)
    if name == "reference":
        normed, total = reference.rms_norm(validate.to_numpy_float(x), validate.to_numpy_float(weight), eps,
                                           None if residual is None else validate.to_numpy_float(residual))
        return (normed, total) if isinstance(x, np.ndarray) else (_like(normed, x), _like(total, x))
    return _backend_module(name).rms_norm(x, weight, eps, residual)


def silu_and_mul(x, backend: str = "auto"):
    """The gated MLP's activation: ``silu(x[..., :d]) * x[..., d:]`` for ``x [..., 2 d]`` (the merged gate and up
    projections' output)."""
    validate.check_silu_and_mul_args(x)
    name = resolve_backend(backend, x)
    if name == "reference":
        result = reference.silu_and_mul(validate.to_numpy_float(x))
        return result if isinstance(x, np.ndarray) else _like(result, x)
    return _backend_module(name).silu_and_mul(x)


def qk_norm_rope_write(q, k, v, q_weight, k_weight, cos_sin_cache, positions, key_cache, value_cache, slot_mapping,
                       eps: float = 1e-6, backend: str = "auto", check: bool = True, kv_cache_dtype: str = "auto",
                       k_scale: float = 1.0, v_scale: float = 1.0):
    """Qwen3's per-head q/k RMSNorm, rotary embedding and the paged cache write, in one op: ``q [T, Hq, D]``,
    ``k``/``v [T, Hk, D]`` (views of the merged qkv projection may be passed), ``cos_sin_cache [max_position, 2 D]``
    (cos then sin, HF's layout: ``rotate_half`` pairs element ``i`` with ``i + D / 2``), ``positions [T]``. The
    rotated keys and ``v`` go to the caches at ``slot_mapping`` (negative: padding, skipped); returns the rotated
    ``(q, k)`` (prefill attends over its own keys too). ``check`` reads the slots and positions (a device sync).
    An FP8 ``kv_cache_dtype`` quantizes what it writes, as ``write_kv_cache`` does; the returned ``(q, k)`` are not."""
    kv_cache_dtype, k_scale, v_scale = _check_precision(kv_cache_dtype, k_scale, v_scale)
    validate.check_qk_norm_rope_write_args(q, k, v, q_weight, k_weight, cos_sin_cache, positions, key_cache,
                                           value_cache, slot_mapping, kv_cache_dtype)
    eps = validate.check_eps(eps)
    if check:
        validate.check_write_args(k, v, key_cache, value_cache, slot_mapping, kv_cache_dtype)
        validate.check_positions(positions, validate.shape_of(cos_sin_cache)[0])
    name = resolve_backend(backend, key_cache, caches=(key_cache, value_cache))
    slot_mapping = validate.index_like(slot_mapping, key_cache)
    precision = (kv_cache_dtype, k_scale, v_scale) if fp8.is_fp8(kv_cache_dtype) else ()
    if name == "reference":
        if not isinstance(key_cache, np.ndarray):
            _require_cpu_float(key_cache)
        caches = (key_cache, value_cache) if isinstance(key_cache, np.ndarray) else \
            (key_cache.numpy(), value_cache.numpy())
        q_out, k_out = reference.qk_norm_rope_write(
            *(validate.to_numpy_float(t) for t in (q, k, v, q_weight, k_weight, cos_sin_cache)),
            validate.to_numpy(positions), *caches, validate.to_numpy(slot_mapping), eps, *precision)
        return (q_out, k_out) if isinstance(q, np.ndarray) else (_like(q_out, q), _like(k_out, k))
    positions = validate.index_like(positions, key_cache)
    return _backend_module(name).qk_norm_rope_write(q, k, v, q_weight, k_weight, cos_sin_cache, positions, key_cache,
                                                    value_cache, slot_mapping, eps, *precision)


def _like(array: np.ndarray, tensor):
    import torch

    return torch.from_numpy(array).to(device=tensor.device, dtype=tensor.dtype)


def _backend_module(name: str):
    if name == "reference":
        return _ReferenceOnTensors
    if name == "torch":
        from . import torch_backend
        return torch_backend
    from . import cupy_backend
    return cupy_backend


class _ReferenceOnTensors:
    """Runs the NumPy reference on torch CPU tensors in place (their NumPy views share memory)."""

    @staticmethod
    def write_kv_cache(key, value, key_cache, value_cache, slot_mapping, *precision):
        if isinstance(key_cache, np.ndarray):
            return reference.write_kv_cache(key, value, key_cache, value_cache, validate.to_numpy(slot_mapping),
                                            *precision)
        _require_cpu_float(key_cache)
        convert = validate.to_numpy_float if precision else validate.to_numpy
        reference.write_kv_cache(convert(key), convert(value), key_cache.numpy(), value_cache.numpy(),
                                 validate.to_numpy(slot_mapping), *precision)

    @staticmethod
    def copy_blocks(key_cache, value_cache, mapping):
        if isinstance(key_cache, np.ndarray):
            return reference.copy_blocks(key_cache, value_cache, mapping)
        _require_cpu_float(key_cache)
        reference.copy_blocks(key_cache.numpy(), value_cache.numpy(), validate.to_numpy(mapping))


def _require_cpu_float(tensor) -> None:
    if tensor.is_cuda or tensor.dtype not in _numpy_viewable():
        raise KernelArgumentError(f"backend 'reference' writes in place only into CPU float32/float64/uint8 caches, "
                         f"got {tensor.dtype} on {tensor.device}")


def _numpy_viewable():
    import torch

    return (torch.float32, torch.float64, torch.uint8)  # uint8: FP8 codes
