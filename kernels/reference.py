"""float64 NumPy reference: the literal block-table walk with an online softmax. The truth for every backend."""
from __future__ import annotations

import numpy as np


def write_kv_cache(key, value, key_cache, value_cache, slot_mapping) -> None:
    """Store token ``t``'s K/V at slot ``slot_mapping[t]`` (block ``slot // block_size``, offset ``slot % block_size``);
    negative slots are padding and are skipped."""
    block_size = key_cache.shape[2]
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


def paged_attention_decode(query, key_cache, value_cache, block_tables, seq_lens, scale: float) -> np.ndarray:
    """One query token per sequence attends to all ``seq_lens[s]`` cached positions of that sequence (GQA)."""
    query = np.asarray(query, dtype=np.float64)
    key_cache = np.asarray(key_cache, dtype=np.float64)
    value_cache = np.asarray(value_cache, dtype=np.float64)
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

