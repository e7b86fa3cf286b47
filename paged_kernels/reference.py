"""float64 NumPy reference: the literal block-table walk with an online softmax. The truth for every backend."""
from __future__ import annotations

import numpy as np

from . import fp8


def write_kv_cache(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype: str = "auto",
                   k_scale: float = 1.0, v_scale: float = 1.0, device_type: str = "cpu") -> None:
    """Store token ``t``'s K/V at slot ``slot_mapping[t]`` (block ``slot // block_size``, offset ``slot % block_size``);
    negative slots are padding and are skipped. An FP8 ``kv_cache_dtype`` stores ``fp8.quantize(K, k_scale)`` and
    ``fp8.quantize(V, v_scale)`` (the caches hold the byte codes), written as vLLM writes on ``device_type``."""
    block_size = key_cache.shape[2]
    if fp8.is_fp8(kv_cache_dtype):
        key, value = (fp8.quantize(x, scale, kv_cache_dtype, device_type) for x, scale in ((key, k_scale),
                                                                                          (value, v_scale)))
    for token, slot in enumerate(np.asarray(slot_mapping).tolist()):
        if slot < 0:
            continue
        key_cache[slot // block_size, :, slot % block_size, :] = key[token]
        value_cache[slot // block_size, :, slot % block_size, :] = value[token]


def copy_blocks(key_cache, value_cache, block_mapping) -> None:
    """Copy whole blocks ``src -> dst`` for each ``(src, dst)`` row, in order."""
    for src, dst in np.asarray(block_mapping, dtype=np.int64).reshape(-1, 2).tolist():
        key_cache[dst] = key_cache[src]
        value_cache[dst] = value_cache[src]


def dequantized(cache, kv_cache_dtype: str = "auto", cache_scale: float = 1.0) -> np.ndarray:
    """A cache's elements as float64: FP8 codes times their scale, the model's dtype as it is."""
    if fp8.is_fp8(kv_cache_dtype):
        return fp8.dequantize(cache, cache_scale, kv_cache_dtype)
    return np.asarray(cache, dtype=np.float64)


def paged_attention_decode(query, key_cache, value_cache, block_tables, seq_lens, scale: float,
                           kv_cache_dtype: str = "auto", k_scale: float = 1.0, v_scale: float = 1.0) -> np.ndarray:
    """One query token per sequence attends to all ``seq_lens[s]`` cached positions of that sequence (GQA), over
    the dequantized K/V in float64 (``dequantized``)."""
    query = np.asarray(query, dtype=np.float64)
    key_cache = dequantized(key_cache, kv_cache_dtype, k_scale)
    value_cache = dequantized(value_cache, kv_cache_dtype, v_scale)
    num_seqs, num_q_heads, head_dim = query.shape
    num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = np.empty_like(query)
    for s in range(num_seqs):
        for q_head in range(num_q_heads):
            kv_head = q_head // group
            out[s, q_head] = _attend_one(query[s, q_head] * scale, key_cache[:, kv_head], value_cache[:, kv_head],
                                         block_tables[s], int(seq_lens[s]), block_size)
    return out


def _attend_one(q, keys, values, block_table, seq_len: int, block_size: int) -> np.ndarray:
    """Online softmax over the sequence's blocks: running max ``m``, running sum ``total``, running output ``acc``.
    An empty sequence attends to nothing: zeros."""
    m, total, acc = -np.inf, 0.0, np.zeros(q.shape[0])
    for logical in range(-(-seq_len // block_size)):
        physical = int(block_table[logical])
        n = min(block_size, seq_len - logical * block_size)
        scores = keys[physical, :n] @ q
        m_new = max(m, scores.max())
        p = np.exp(scores - m_new)
        correction = np.exp(m - m_new)
        total = total * correction + p.sum()
        acc = acc * correction + p @ values[physical, :n]
        m = m_new
    return acc / total if total > 0 else acc



def rms_norm(x, weight, eps: float, residual=None) -> tuple[np.ndarray, np.ndarray]:
    """``(normed, residual_out)``: with ``residual``, ``residual_out = x + residual`` and the norm is of that sum
    (the fused residual add); without, ``residual_out = x``. ``normed = r / sqrt(mean(r ** 2) + eps) * weight``
    over the last axis."""
    x = np.asarray(x, dtype=np.float64)
    total = x if residual is None else x + np.asarray(residual, dtype=np.float64)
    normed = total / np.sqrt(np.mean(total ** 2, axis=-1, keepdims=True) + eps) * np.asarray(weight, np.float64)
    return normed, total


def silu_and_mul(x) -> np.ndarray:
    """``silu(x[..., :d]) * x[..., d:]`` for ``x [..., 2d]`` (the gated MLP's activation)."""
    x = np.asarray(x, dtype=np.float64)
    gate, up = np.split(x, 2, axis=-1)
    return gate / (1 + np.exp(-gate)) * up


def qk_norm_rope_write(q, k, v, q_weight, k_weight, cos_sin_cache, positions, key_cache, value_cache, slot_mapping,
                       eps: float, kv_cache_dtype: str = "auto", k_scale: float = 1.0,
                       v_scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Per head: RMSNorm over ``head_dim`` (``q_weight`` / ``k_weight``), then rotary at each token's position
    (``cos_sin_cache [max_position, 2 * head_dim]``: cos, then sin, each over the whole head as HF lays them out;
    ``rotate_half`` pairs element ``i`` with ``i + head_dim / 2``); the rotated keys and ``v`` are written to the
    caches at ``slot_mapping`` (negative: padding). Returns the rotated ``(q, k)``."""
    head_dim = np.asarray(q).shape[-1]
    table = np.asarray(cos_sin_cache, dtype=np.float64)[np.asarray(positions)]
    cos, sin = table[:, None, :head_dim], table[:, None, head_dim:]

    def rotate(x, weight):
        x = rms_norm(x, weight, eps)[0]
        half = head_dim // 2
        rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
        return x * cos + rotated * sin

    q_out, k_out = rotate(q, q_weight), rotate(k, k_weight)
    if fp8.is_fp8(kv_cache_dtype):
        write_kv_cache(k_out, np.asarray(v, dtype=np.float64), key_cache, value_cache, slot_mapping, kv_cache_dtype,
                       k_scale, v_scale)
    else:
        write_kv_cache(k_out.astype(key_cache.dtype), np.asarray(v, dtype=value_cache.dtype), key_cache, value_cache,
                       slot_mapping)
    return q_out, k_out
