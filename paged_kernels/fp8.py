"""FP8 KV-cache elements, in NumPy: the formats, their 256 values, and the float64 quantize / dequantize that define
the contract every backend meets.

A cache of ``kv_cache_dtype`` ``fp8_e4m3`` (``fp8`` is its alias) or ``fp8_e5m2`` stores one byte per element
(``uint8`` tensors, as vLLM's CPU and CUDA caches do) and a per-tensor scale for K and for V (vLLM's ``k_scale`` /
``v_scale``). Writing element ``x`` follows vLLM's write on the same device (``quantize``): on a CPU
``fp8_toward_zero(clamp(float32(x) * (float32(1) / float32(scale)), -max, max))`` (``k_inv = 1.0f / k_scale`` in
``cpu_attn_reshape_and_cache``, csrc/cpu/cpu_attn.cpp; ``float_to_fp8e4m3_scalar`` / ``float_to_fp8e5m2_scalar`` in
csrc/cpu/cpu_attn_fp8.hpp drop the float32 mantissa bits below FP8's), on a CUDA GPU ``fp8_nearest_even(clamp(
float32(x) / float32(scale), -max, max))`` (``__nv_cvt_float_to_fp8`` with ``__NV_SATFINITE``). Values past the format's largest finite ``max`` saturate to ``+-max`` (never NaN or
inf), as every vLLM conversion does. Reading:
``value(code) * scale``, exactly, in float64 here (the kernels in float32; vLLM's CPU kernel dequantizes exactly too).
``e4m3`` is the ``fn`` variant (no infinities, 0x7F/0xFF are NaN, max 448); ``e5m2`` is IEEE-like (max 57344).
"""
from __future__ import annotations

import functools

import numpy as np

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")  # vLLM's CacheConfig.cache_dtype names
FP8_FORMATS = {"fp8": "e4m3", "fp8_e4m3": "e4m3", "fp8_e5m2": "e5m2"}
# exponent bits, mantissa bits, exponent bias
_LAYOUT = {"e4m3": (4, 3, 7), "e5m2": (5, 2, 15)}


def is_fp8(kv_cache_dtype: str) -> bool:
    """Whether ``kv_cache_dtype`` stores FP8 bytes."""
    return kv_cache_dtype in FP8_FORMATS


def fp8_format(kv_cache_dtype: str) -> str:
    """``e4m3`` or ``e5m2`` for an FP8 ``kv_cache_dtype``."""
    return FP8_FORMATS[kv_cache_dtype]


@functools.lru_cache(maxsize=None)
def decode_table(kv_cache_dtype: str) -> np.ndarray:
    """The float64 value of each of the 256 byte codes (NaN for the NaN codes, +-inf for e5m2's infinities)."""
    exp_bits, man_bits, bias = _LAYOUT[fp8_format(kv_cache_dtype)]
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent = (codes >> man_bits) & ((1 << exp_bits) - 1)
    mantissa = codes & ((1 << man_bits) - 1)
    normal = (1 + mantissa / (1 << man_bits)) * np.exp2(exponent.astype(np.float64) - bias)
    subnormal = mantissa / (1 << man_bits) * 2.0 ** (1 - bias)
    table = sign * np.where(exponent == 0, subnormal, normal)
    top = exponent == (1 << exp_bits) - 1
    if exp_bits == 4:  # e4m3fn: only S.1111.111 is NaN, the rest of the top exponent holds finite values
        table[(codes & 0x7F) == 0x7F] = np.nan
    else:  # e5m2: IEEE, the top exponent is inf (mantissa 0) or NaN
        table[top & (mantissa == 0)] = sign[top & (mantissa == 0)] * np.inf
        table[top & (mantissa != 0)] = np.nan
    table.setflags(write=False)
    return table


def max_finite(kv_cache_dtype: str) -> float:
    """The format's largest finite value: 448 (e4m3), 57344 (e5m2)."""
    table = decode_table(kv_cache_dtype)
    return float(np.nanmax(np.where(np.isfinite(table), table, np.nan)))


@functools.lru_cache(maxsize=None)
def _positive_codes(kv_cache_dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """The finite non-negative codes in increasing value (the codes 0x00.. are monotonic in value) and values."""
    table = decode_table(kv_cache_dtype)
    codes = np.flatnonzero(np.isfinite(table[:128]))
    return codes.astype(np.uint8), table[codes]


def inverse_scale(scale: float) -> np.float32:
    """``float32(1) / float32(scale)``: what a value is multiplied by before it is rounded to FP8 (vLLM's CPU
    ``k_inv`` / ``v_inv``)."""
    return np.float32(1.0) / np.float32(scale)


WRITE_DEVICES = ("cpu", "cuda")  # whose vLLM write a quantization follows (``quantize``'s ``device_type``)


def quantize(x, scale: float, kv_cache_dtype: str, device_type: str = "cpu") -> np.ndarray:
    """FP8 byte codes (``uint8``, ``x``'s shape) as vLLM writes them on ``device_type``, clamped to the format's finite
    range first (never NaN or inf from a finite value; NaN stays NaN):

    * ``cpu``: ``x * inverse_scale(scale)`` in float32, rounded toward zero (the largest magnitude not above the
      value's; vLLM's CPU write, csrc/cpu/cpu_attn_fp8.hpp). A zero gives code 0x00 (a negative zero too); a nonzero
      value under the smallest subnormal keeps its sign (0x80 when negative).
    * ``cuda``: ``x / scale`` in float32, rounded to nearest, ties to the even code (vLLM's CUDA write:
      ``__nv_cvt_float_to_fp8(x / scale, __NV_SATFINITE, ...)`` in csrc/quantization/fp8/nvidia/quant_utils.cuh),
      signed zeros kept.

    The CPU backends (the C++ extension, torch on a CPU, this reference by default) write as vLLM's CPU build, the
    CUDA ones (CuPy, torch on a GPU) as its CUDA build: each engine is compared with vLLM on the same device."""
    if device_type not in WRITE_DEVICES:
        from .validate import KernelArgumentError

        raise KernelArgumentError(f"device_type must be one of {', '.join(WRITE_DEVICES)}, got {device_type!r:.40}")
    x = np.asarray(x, dtype=np.float32)
    y = (x * inverse_scale(scale) if device_type == "cpu" else x / np.float32(scale)).astype(np.float64)
    codes, values = _positive_codes(kv_cache_dtype)
    magnitude = np.minimum(np.abs(y), values[-1])
    if device_type == "cpu":
        result = codes[np.clip(np.searchsorted(values, magnitude, side="right") - 1, 0, len(values) - 1)]
        negative = np.signbit(y) & (y != 0)
    else:
        upper = np.clip(np.searchsorted(values, magnitude, side="left"), 1, len(values) - 1)
        lower = upper - 1
        below, above = magnitude - values[lower], values[upper] - magnitude
        take_upper = (above < below) | ((above == below) & (codes[upper] % 2 == 0))
        result = np.where(take_upper, codes[upper], codes[lower])
        negative = np.signbit(y)
    result = np.where(negative, result.astype(np.uint8) | 0x80, result).astype(np.uint8)
    nan_code = 0x7F if fp8_format(kv_cache_dtype) == "e4m3" else 0x7E
    return np.where(np.isnan(y), np.uint8(nan_code), result).astype(np.uint8)


def dequantize(codes, scale: float, kv_cache_dtype: str) -> np.ndarray:
    """float64 values of FP8 byte codes: ``value(code) * scale``."""
    return decode_table(kv_cache_dtype)[np.asarray(codes, dtype=np.uint8)] * float(scale)


def check_kv_cache_dtype(kv_cache_dtype) -> str:
    """``kv_cache_dtype`` when it is one of ``KV_CACHE_DTYPES``; else a ``KernelArgumentError``."""
    from .validate import KernelArgumentError

    if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in KV_CACHE_DTYPES:
        raise KernelArgumentError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                                  f"{kv_cache_dtype!r:.60}")
    return kv_cache_dtype


def check_kv_scale(name: str, scale) -> float:
    """A K or V scale: a finite number > 0."""
    from .validate import KernelArgumentError

    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)) or \
            not np.isfinite(float(scale)) or float(scale) <= 0:
        raise KernelArgumentError(f"{name} must be a finite number > 0, got {scale!r:.60}")
    return float(scale)
