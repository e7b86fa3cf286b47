"""FP8 KV-cache elements, in NumPy: the formats, their 256 values, and the float64 quantize / dequantize that define
the contract every backend meets.

A cache of ``kv_cache_dtype`` ``fp8_e4m3`` (``fp8`` is its alias) or ``fp8_e5m2`` stores one byte per element
(``uint8`` tensors, as vLLM's CPU and CUDA caches do) and a per-tensor scale for K and for V (vLLM's ``k_scale`` /
``v_scale``). Writing element ``x`` follows vLLM's CPU backend (the engine it is compared with):
``code = fp8_toward_zero(clamp(float32(x) * inv, -max, max))`` with ``inv = float32(1) / float32(scale)``: the
reciprocal's multiply, in float32 (``k_inv = 1.0f / k_scale`` in ``cpu_attn_reshape_and_cache``,
csrc/cpu/cpu_attn.cpp), rounded **toward zero** (the largest code whose magnitude does not exceed the value's: vLLM's
``float_to_fp8e4m3_scalar`` / ``float_to_fp8e5m2_scalar`` in csrc/cpu/cpu_attn_fp8.hpp drop the float32 mantissa bits
below FP8's, subnormals included), a zero (either sign) giving code 0x00 and a nonzero value below the smallest
subnormal a signed zero. Values past the format's largest finite ``max`` saturate to ``+-max`` (never NaN or inf), as
every vLLM conversion does (the clamp above; ``__NV_SATFINITE`` in its CUDA ``scaled_convert``). Reading:
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


def quantize(x, scale: float, kv_cache_dtype: str) -> np.ndarray:
    """FP8 byte codes (``uint8``, ``x``'s shape) of ``x * inverse_scale(scale)``: the multiply in float32, clamped to
    the format's finite range, rounded toward zero (the largest magnitude not above the value's; vLLM's CPU
    rounding). A zero gives code 0x00 (a negative zero too); a nonzero value under the smallest subnormal keeps its
    sign (0x80 when negative). NaN stays NaN."""
    y = (np.asarray(x, dtype=np.float32) * inverse_scale(scale)).astype(np.float64)
    codes, values = _positive_codes(kv_cache_dtype)
    magnitude = np.minimum(np.abs(y), values[-1])
    below = np.clip(np.searchsorted(values, magnitude, side="right") - 1, 0, len(values) - 1)
    result = codes[below].astype(np.uint8)
    result = np.where(np.signbit(y) & (y != 0), result | 0x80, result).astype(np.uint8)
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
