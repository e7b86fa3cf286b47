"""KV cache precision: the element types a paged KV cache may store, by vLLM's names (``kv_cache_dtype``).

``auto`` stores K and V in the model's dtype; ``fp8`` (an alias of ``fp8_e4m3``), ``fp8_e4m3`` and ``fp8_e5m2``
store one byte per element with a per-tensor scale (vLLM's ``k_scale`` / ``v_scale``), as vLLM's
``CacheConfig.cache_dtype`` (vllm/config/cache.py) names them. One definition for the engine, the simulator and the
planner: what an element costs in bytes.
"""
from __future__ import annotations

from lab.errors import InputError

# paged_kernels.fp8.KV_CACHE_DTYPES, restated: importing paged_kernels loads torch, which the simulator's commands
# and pages must not (tests/test_import_direction.py); tests/test_fp8_kv.py holds the two equal
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")

FP8_KV_CACHE_DTYPES = KV_CACHE_DTYPES[1:]


def check_kv_cache_dtype(owner: str, value) -> str:
    """``value`` when it is one of ``KV_CACHE_DTYPES``; else an ``InputError`` naming ``owner``'s field."""
    if not isinstance(value, str) or value not in KV_CACHE_DTYPES:
        raise InputError(f"{owner}.kv_cache_dtype={value!r:.60}: expected one of {', '.join(KV_CACHE_DTYPES)}")
    return value


def kv_element_bytes(kv_cache_dtype: str, model_dtype_bytes: int) -> int:
    """Bytes of one stored K or V element: the model's dtype's for ``auto``, one for the FP8 formats."""
    return model_dtype_bytes if kv_cache_dtype == "auto" else 1
