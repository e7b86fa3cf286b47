"""The v2 (split-K) decode math in torch: per-partition softmax pieces and their reduction.

The CUDA v2 kernel partitions each sequence's context into ``PARTITION_SIZE``-token pieces, computes for each piece
its max score ``m_p``, its sum of exponentials ``l_p`` and its normalised output ``o_p``, then reduces them:
``M = max_p m_p``, ``w_p = l_p * exp(m_p - M)``, ``out = sum_p w_p * o_p / sum_p w_p``. This module does the same
arithmetic on CPU so the reduction is checked against the reference without a GPU.
"""
from __future__ import annotations

import torch

from .torch_backend import gather_kv

PARTITION_SIZE = 512


def partition_attention(query, key_cache, value_cache, block_tables, seq_lens, scale: float,
                        partition_size: int = PARTITION_SIZE):
    """Return ``(max_logits, exp_sums, partial_out)`` shaped ``[S, Hq, P]``, ``[S, Hq, P]``, ``[S, Hq, P, D]``."""
    num_seqs, num_q_heads, head_dim = query.shape
    num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    max_len = int(seq_lens.max())
    num_parts = max(1, -(-max_len // partition_size))
    num_blocks_used = max(1, -(-max_len // block_size))
    keys = gather_kv(key_cache, block_tables.long(), num_blocks_used).double()
    values = gather_kv(value_cache, block_tables.long(), num_blocks_used).double()
    padded = num_parts * partition_size
    keys = torch.nn.functional.pad(keys[:, :, :max_len], (0, 0, 0, padded - max_len))
    values = torch.nn.functional.pad(values[:, :, :max_len], (0, 0, 0, padded - max_len))
    q = query.double().view(num_seqs, num_kv_heads, -1, 1, 1, head_dim)
    keys = keys.view(num_seqs, num_kv_heads, 1, num_parts, partition_size, head_dim)
    values = values.view(num_seqs, num_kv_heads, 1, num_parts, partition_size, head_dim)
    scores = (q * keys).sum(-1) * scale  # [S, Hk, G, P, partition]
    positions = torch.arange(padded).view(num_parts, partition_size)
    beyond_end = positions >= seq_lens.long().view(-1, 1, 1, 1, 1)
    scores = scores.masked_fill(beyond_end, float("-inf"))
    values = values.masked_fill(beyond_end.unsqueeze(-1), 0.0)
    max_logits = scores.amax(-1)
    probs = torch.exp(scores - max_logits.unsqueeze(-1)).nan_to_num(0.0)
    exp_sums = probs.sum(-1)
    partial_out = (probs.unsqueeze(-1) * values).sum(-2) / exp_sums.clamp_min(1e-300).unsqueeze(-1)
    return (max_logits.reshape(num_seqs, num_q_heads, num_parts), exp_sums.reshape(num_seqs, num_q_heads, num_parts),
            partial_out.reshape(num_seqs, num_q_heads, num_parts, head_dim))


def reduce_partitions(max_logits, exp_sums, partial_out):
    """Combine per-partition ``(m_p, l_p, o_p)`` into the full softmax output ``[S, Hq, D]``."""
    global_max = max_logits.amax(-1, keepdim=True)
    weights = (exp_sums * torch.exp(max_logits - global_max)).nan_to_num(0.0)
    return (weights.unsqueeze(-1) * partial_out).sum(-2) / weights.sum(-1, keepdim=True).clamp_min(1e-300)


def split_k_decode(query, key_cache, value_cache, block_tables, seq_lens, scale: float,
                   partition_size: int = PARTITION_SIZE):
    """Decode attention computed as the v2 kernel does: partitions, then the reduction (float64)."""
    pieces = partition_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, partition_size)
    return reduce_partitions(*pieces)
