"""Fresh random inputs for kernel tests: shuffled physical blocks, NaN-poisoned unused slots."""
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class DecodeCase:
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor


@dataclass(slots=True)
class WriteCase:
    key: torch.Tensor
    value: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    slot_mapping: torch.Tensor


def make_decode_case(seq_lens, block_size, num_kv_heads, group, head_dim, dtype=torch.float32, device="cpu"):
    """Caches whose blocks are a random permutation; slots past each sequence's end hold NaN, so any read of them
    shows in the output."""
    generator = torch.Generator().manual_seed(int(np.random.SeedSequence().entropy % 2**31))
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    key_cache = torch.full(shape, float("nan"))
    value_cache = torch.full(shape, float("nan"))
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables = torch.zeros((len(seq_lens), max(blocks_per_seq)), dtype=torch.int32)
    for s, (length, count) in enumerate(zip(seq_lens, blocks_per_seq)):
        for logical in range(count):
            physical = order.pop()
            tables[s, logical] = physical
            used = min(block_size, length - logical * block_size)
            key_cache[physical, :, :used] = torch.randn(num_kv_heads, used, head_dim, generator=generator)
            value_cache[physical, :, :used] = torch.randn(num_kv_heads, used, head_dim, generator=generator)
    query = torch.randn(len(seq_lens), num_kv_heads * group, head_dim, generator=generator)
    to = dict(device=device, dtype=dtype)
    return DecodeCase(query.to(**to), key_cache.to(**to), value_cache.to(**to), tables.to(device),
                      torch.tensor(seq_lens, dtype=torch.int32, device=device))


def make_write_case(num_tokens, block_size, num_blocks, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                    device="cpu"):
    """NaN caches, random K/V, distinct random slots with every fourth token marked as padding (-1)."""
    generator = torch.Generator().manual_seed(int(np.random.SeedSequence().entropy % 2**31))
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    slots[::4] = -1
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    to = dict(device=device, dtype=dtype)
    return WriteCase(torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(**to),
                     torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(**to),
                     torch.full(shape, float("nan"), **to), torch.full(shape, float("nan"), **to), slots.to(device))


def relative_error(out, expected) -> float:
    """max |out - expected| / max |expected|, in float64; NaN anywhere counts as infinite error."""
    out = out.detach().double().cpu().numpy() if isinstance(out, torch.Tensor) else np.asarray(out, np.float64)
    if not np.isfinite(out).all():
        return float("inf")
    return float(np.abs(out - expected).max() / np.abs(expected).max())


def make_fp8_decode_case(seq_lens, block_size, num_kv_heads, group, head_dim, kv_cache_dtype, k_scale=1.0,
                         v_scale=1.0, dtype=torch.float32, spread=1.0):
    """``make_decode_case`` with its caches stored as FP8 codes (``uint8``): K and V drawn at ``spread`` times a
    standard normal, quantized by the NumPy contract; unused slots hold the format's NaN code (the NaN float's)."""
    from paged_kernels import fp8

    case = make_decode_case(seq_lens, block_size, num_kv_heads, group, head_dim)
    for name, cache_scale in (("key_cache", k_scale), ("value_cache", v_scale)):
        codes = fp8.quantize(getattr(case, name).numpy() * spread, cache_scale, kv_cache_dtype)
        setattr(case, name, torch.from_numpy(codes))
    case.query = case.query.to(dtype)
    return case
