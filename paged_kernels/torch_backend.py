"""torch backend (CPU and CUDA): vectorised gathers through the block tables, no Python loop over tokens."""
from __future__ import annotations

import threading

import torch

from . import fp8
from .validate import is_cuda

# Sequences are processed in chunks whose gathered K/V stay about this size, so the gather copy is still in cache
# when attention reads it (on CPU the gather otherwise costs two extra trips to memory).
GATHER_CHUNK_BYTES = 8 << 20


FP8_TORCH_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def _fp8_dtype(kv_cache_dtype: str) -> torch.dtype:
    return FP8_TORCH_DTYPES[fp8.fp8_format(kv_cache_dtype)]


def quantize(x: torch.Tensor, cache_scale: float, kv_cache_dtype: str) -> torch.Tensor:
    """FP8 codes (``uint8``) of ``x`` as vLLM writes them on ``x``'s device (``paged_kernels.fp8.quantize``'s
    contract), clamped to the format's finite range (torch's own conversion gives inf past e5m2's 57344). On a CPU:
    multiplied by ``fp8.inverse_scale`` in float32 and rounded toward zero (torch's conversion rounds to nearest,
    and a code whose magnitude came out above the value's steps one code down: the codes' magnitudes are monotonic);
    on a GPU: divided in float32 and rounded to nearest even, as torch's conversion rounds."""
    limit = fp8.max_finite(kv_cache_dtype)
    if x.is_cuda:
        return (x.to(torch.float32) / cache_scale).clamp_(-limit, limit).to(_fp8_dtype(kv_cache_dtype)).view(
            torch.uint8)
    y = (x.to(torch.float32) * float(fp8.inverse_scale(cache_scale))).clamp_(-limit, limit)
    nearest = y.to(_fp8_dtype(kv_cache_dtype))
    over = nearest.to(torch.float32).abs() > y.abs()  # NaN: False, stays NaN
    codes = nearest.view(torch.uint8) - over.to(torch.uint8)
    return codes.masked_fill_(y == 0, 0)  # a negative zero too: code 0x00, as vLLM's


def dequantize(codes: torch.Tensor, cache_scale: float, kv_cache_dtype: str,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """float32 (or ``dtype``) values of FP8 codes: ``value(code) * cache_scale``."""
    return (codes.view(_fp8_dtype(kv_cache_dtype)).to(torch.float32) * cache_scale).to(dtype)


def dequantization_table(kv_cache_dtype: str, cache_scale: float) -> torch.Tensor:
    """The 256 codes' values times ``cache_scale``, float32: what the C++ kernels dequantize with (one lookup per
    element)."""
    key = (kv_cache_dtype, float(cache_scale))
    table = _tables.get(key)
    if table is None:
        table = dequantize(torch.arange(256, dtype=torch.uint8), cache_scale, kv_cache_dtype).contiguous()
        if len(_tables) > 256:
            _tables.clear()
        _tables[key] = table
    return table


_tables: dict = {}
_NO_TABLE = torch.empty(0, dtype=torch.float32)


def _luts(kv_cache_dtype: str, k_scale: float, v_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    if not fp8.is_fp8(kv_cache_dtype):
        return _NO_TABLE, _NO_TABLE
    return dequantization_table(kv_cache_dtype, k_scale), dequantization_table(kv_cache_dtype, v_scale)


def write_kv_cache(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype: str = "auto",
                   k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Scatter K/V rows to their slots; negative slots (padding) are skipped. An FP8 ``kv_cache_dtype`` quantizes
    first (``quantize``)."""
    if fp8.is_fp8(kv_cache_dtype):
        key, value = quantize(key, k_scale, kv_cache_dtype), quantize(value, v_scale, kv_cache_dtype)
    block_size = key_cache.shape[2]
    slot_mapping = slot_mapping.to(device=key_cache.device, dtype=torch.long)
    padding = drop_padding if key_cache.is_cpu else redirect_padding
    slot_mapping, key, value = padding(slot_mapping, key, value, key_cache, value_cache)
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    key_cache[blocks, :, offsets] = key
    value_cache[blocks, :, offsets] = value


def drop_padding(slot_mapping, key, value, key_cache=None, value_cache=None):
    """The rows of a write whose slots are not padding (negative). Reads whether any is padding back: on a GPU, a
    sync (``redirect_padding`` instead)."""
    keep = slot_mapping >= 0
    if bool(keep.all()):
        return slot_mapping, key, value
    return slot_mapping[keep], key[keep], value[keep]


def redirect_padding(slot_mapping, key, value, key_cache, value_cache):
    """A write's rows with each padding row turned into a harmless duplicate, without reading anything back from the
    device: it writes the first real row's K/V to that row's slot (the same values twice, so either write may land
    last), or, in a write with no real row, slot 0's own K/V back to slot 0. On CUDA, ``drop_padding`` would wait for
    the GPU once per layer to learn how many rows stay."""
    keep = slot_mapping >= 0
    # the first kept row (0 when none is) as a one-element index: a 0-d tensor index is read back like an int
    any_kept, first = keep.any(), keep.to(torch.int8).argmax(dim=0, keepdim=True)
    target = torch.where(any_kept, slot_mapping[first], 0)
    block, offset = target // key_cache.shape[2], target % key_cache.shape[2]
    rows = keep[:, None, None]
    key = torch.where(rows, key, torch.where(any_kept, key[first], key_cache[block, :, offset]))
    value = torch.where(rows, value, torch.where(any_kept, value[first], value_cache[block, :, offset]))
    return torch.where(keep, slot_mapping, target), key, value


def copy_blocks(key_cache, value_cache, block_mapping) -> None:
    """Copy whole blocks ``src -> dst`` (rows of ``block_mapping``), in order."""
    for src, dst in block_mapping.reshape(-1, 2).tolist():
        key_cache[dst].copy_(key_cache[src])
        value_cache[dst].copy_(value_cache[src])


def swap_blocks(src_key_cache, src_value_cache, dst_key_cache, dst_value_cache, block_mapping) -> None:
    """``dst[d] = src[s]`` for each ``(s, d)`` pair, across devices (device <-> host). Host -> device is asynchronous
    (stream-ordered); device -> host waits once for the stream, because the host pool is then written by the CPU."""
    if len(block_mapping) == 0:
        return
    src_index = block_mapping[:, 0].to(src_key_cache.device)
    dst_index = block_mapping[:, 1].to(dst_key_cache.device)
    pairs = ((src_key_cache, dst_key_cache), (src_value_cache, dst_value_cache))
    moved = [src.index_select(0, src_index).to(dst.device, non_blocking=True) for src, dst in pairs]
    if is_cuda(src_key_cache) and not is_cuda(dst_key_cache):
        # a non-blocking device -> host copy lands in pinned memory whenever the stream gets to it; reading it on the
        # CPU before then (the index_copy_ below) would store whatever that memory held
        synchronize(src_key_cache.device)
    for (_, dst), blocks in zip(pairs, moved):
        dst.index_copy_(0, dst_index, blocks)


def synchronize(device) -> None:
    """Wait until torch's current stream on ``device`` has run everything queued on it (nothing to wait for on a
    CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def paged_attention_decode(query, key_cache, value_cache, block_tables, seq_lens, scale: float,
                           out: torch.Tensor | None = None, max_seq_len: int | None = None,
                           kv_cache_dtype: str = "auto", k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """GQA decode attention over paged K/V, computed block-wise straight from the gathered blocks (no re-layout).

    Softmax statistics are float32; on CPU half types are computed in float32 throughout. ``max_seq_len``: the
    longest of ``seq_lens`` if known (else read from them: a device sync on CUDA). FP8 caches are dequantized as
    they are loaded (``dequantize``; the C++ kernel through ``dequantization_table``).
    """
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device) if out is None else out
    seq_lens = seq_lens.to(device=key_cache.device, dtype=torch.long)
    precision = (kv_cache_dtype, k_scale, v_scale)
    if query.is_cpu and IN_PLACE_CPU and _in_place(query, key_cache, value_cache, block_tables, seq_lens, scale, out,
                                                   precision):
        return out
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max()) if len(seq_lens) else 0
    num_blocks_used = min(-(-int(max_seq_len) // key_cache.shape[2]), block_tables.shape[1])
    if num_blocks_used == 0:  # every sequence is empty
        return out.zero_()
    # Entries past a sequence's blocks are padding and may hold any value (-1 by convention): clamped into the pool
    # so the gather never reads outside it, and masked out below.
    block_tables = block_tables[:, :num_blocks_used].to(device=key_cache.device, dtype=torch.long).clamp(
        0, key_cache.shape[0] - 1)
    step = _chunk_size(query, key_cache, num_blocks_used)
    buffers = _gather_buffers(key_cache, step * num_blocks_used)
    for start in range(0, query.shape[0], step):
        end = min(start + step, query.shape[0])
        out[start:end] = _attend_chunk(query[start:end], key_cache, value_cache, block_tables[start:end],
                                       seq_lens[start:end], scale, buffers, precision)
    return out


IN_PLACE_CPU = True  # CPU decode attention reads the pool in place when the extension builds (False: gather, as A/B)


def _in_place(query, key_cache, value_cache, block_tables, seq_lens, scale, out, precision=("auto", 1.0, 1.0)) -> bool:
    """Decode attention by ``cpu_extension`` (no gathered copy); False when it is not built here."""
    from .cpu_extension import extension

    module = extension()
    if module is None:
        return False
    tables = block_tables.to(torch.long).contiguous()
    target = out if out.is_contiguous() else torch.empty_like(query)
    module.paged_attention_decode(target, query.contiguous(), key_cache.contiguous(), value_cache.contiguous(),
                                  tables, seq_lens.contiguous(), float(scale), *_luts(*precision))
    if target is not out:
        out.copy_(target)
    return True


IN_PLACE_PREFILL_CPU = True  # CPU prefill attention reads the pool in place when the extension builds (False: A/B)


def paged_attention_prefill(query, key_cache, value_cache, block_tables, query_start_loc, context_lens, scale: float,
                            out, kv_cache_dtype: str = "auto", k_scale: float = 1.0, v_scale: float = 1.0) -> bool:
    """Causal attention of a step's prompt chunks on a CPU, by ``cpu_extension``, reading the block pool in place
    (each chunk's own keys and values written there first): chunk ``s`` is rows ``query_start_loc[s]`` to
    ``query_start_loc[s + 1]`` of ``query [tokens, num_q_heads, head_dim]``, its first token at position
    ``context_lens[s]`` (the tokens before it are cached), and sees its sequence's tokens up to each row's position
    through ``block_tables[s]``. Writes ``out`` (like ``query``, contiguous). False where it does not serve (not a
    CPU float tensor, a head size it is not built for, the extension not built): the caller attends another way.
    FP8 caches (``kv_cache_dtype``) are dequantized on load."""
    if not (IN_PLACE_PREFILL_CPU and query.is_cpu and query.is_contiguous() and out.is_contiguous()):
        return False
    from .cpu_extension import extension

    module = extension()
    if module is None:
        return False
    return module.paged_attention_prefill(out, query, key_cache.contiguous(), value_cache.contiguous(),
                                          block_tables.contiguous(), query_start_loc, context_lens, float(scale),
                                          *_luts(kv_cache_dtype, k_scale, v_scale))


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax: ``logits.argmax(dim=-1)``'s indices (the first of a tie; NaN ranked highest, as torch ranks
    it), by ``cpu_extension`` for contiguous float32 or bfloat16 rows on a CPU (torch's bfloat16 argmax widens one
    element at a time: 4.4 ms for 16 rows of Qwen3's 151,936-token vocabulary), else by torch."""
    if logits.is_cpu and logits.dim() == 2 and logits.dtype in (torch.float32, torch.bfloat16) and \
            logits.is_contiguous() and logits.shape[1] > 0:
        from .cpu_extension import extension

        module = extension()
        if module is not None:
            return module.argmax_rows(logits)
    return logits.argmax(dim=-1)


FUSED_CPU = True  # q/k norm, rotary and cache write in one C++ pass on the CPU when the extension builds (False: A/B)


_FP8_FORMAT_CODES = {"e4m3": 1, "e5m2": 2}  # the extension's fp8_format (0: the caches hold q's dtype)


def _fused_qk_norm_rope_write(q, k, v, q_weight, k_weight, cos_sin_cache, positions, key_cache, value_cache,
                              slot_mapping, eps: float, kv_cache_dtype: str = "auto", k_scale: float = 1.0,
                              v_scale: float = 1.0):
    """``qk_norm_rope_write`` by ``cpu_extension``: one pass over the tokens instead of ~30 torch ops per layer (on
    the tiny model a prefill or decode step spent ~1 ms of its 2-9 ms in them); None where it does not apply."""
    from .cpu_extension import extension

    quantized = fp8.is_fp8(kv_cache_dtype)
    tensors = (k, v, q_weight, k_weight, cos_sin_cache) + (() if quantized else (key_cache, value_cache))
    if any(t.dtype != q.dtype or not t.is_cpu for t in tensors) or q.dim() != 3 or q.shape[-1] % 2:
        return None
    if quantized and not (key_cache.is_cpu and key_cache.dtype == value_cache.dtype == torch.uint8):
        return None
    module = extension()
    if module is None:
        return None
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        return None
    def inverse_rms(x):  # by torch, as rms_norm computes it: its reduction order keeps the result HF's bit for bit
        return torch.rsqrt(x.to(torch.float32).pow(2).mean(-1) + eps).contiguous()

    q_out, k_out = torch.empty(q.shape, dtype=q.dtype), torch.empty(k.shape, dtype=q.dtype)
    module.qk_norm_rope_write(q_out, k_out, q, k, v, inverse_rms(q), inverse_rms(k), q_weight.contiguous(),
                              k_weight.contiguous(), cos_sin_cache.contiguous(), positions.to(torch.long).contiguous(),
                              key_cache, value_cache, slot_mapping.to(torch.long).contiguous(),
                              _FP8_FORMAT_CODES[fp8.fp8_format(kv_cache_dtype)] if quantized else 0, float(k_scale),
                              float(v_scale))
    return q_out, k_out


def gather_kv(cache, block_tables, num_blocks_used: int):
    """Contiguous ``[num_seqs, num_kv_heads, num_blocks_used * block_size, head_dim]`` copy of a sequence's K or V."""
    num_seqs = block_tables.shape[0]
    _, num_kv_heads, block_size, head_dim = cache.shape
    rows = cache.index_select(0, block_tables[:, :num_blocks_used].reshape(-1).long().clamp(0, cache.shape[0] - 1))
    rows = rows.view(num_seqs, num_blocks_used, num_kv_heads, block_size, head_dim)
    return rows.transpose(1, 2).reshape(num_seqs, num_kv_heads, num_blocks_used * block_size, head_dim)


def _attend_chunk(query, key_cache, value_cache, block_tables, seq_lens, scale, buffers, precision=("auto", 1.0, 1.0)):
    """Scores as ``[seqs, blocks, kv_heads, group, block_size]`` so the gathered blocks are used as they lie."""
    num_seqs, num_q_heads, head_dim = query.shape
    _, num_kv_heads, block_size, _ = key_cache.shape
    num_blocks_used, group = block_tables.shape[1], num_q_heads // num_kv_heads
    index = block_tables.reshape(-1)
    shape = (num_seqs, num_blocks_used, num_kv_heads, block_size, head_dim)
    keys = torch.index_select(key_cache, 0, index, out=buffers[0][: len(index)]).view(shape)
    values = torch.index_select(value_cache, 0, index, out=buffers[1][: len(index)]).view(shape)
    compute = torch.float32 if query.is_cpu else query.dtype
    kv_cache_dtype, k_scale, v_scale = precision
    if fp8.is_fp8(kv_cache_dtype):
        keys, values = dequantize(keys, k_scale, kv_cache_dtype, compute), dequantize(values, v_scale, kv_cache_dtype,
                                                                                       compute)
    q = query.view(num_seqs, 1, num_kv_heads, group, head_dim).to(compute)
    scores = torch.matmul(q, keys.to(compute).transpose(-1, -2)).float().mul_(scale)
    positions = torch.arange(num_blocks_used * block_size, device=query.device).view(num_blocks_used, 1, 1, block_size)
    beyond_end = positions >= seq_lens.view(num_seqs, 1, 1, 1, 1)
    scores.masked_fill_(beyond_end, float("-inf"))
    # Stale slots may hold anything, NaN included (0 * NaN = NaN): zero them, on CPU touching only the tail blocks
    # (on CUDA finding those would wait for the GPU; masking every block costs less)
    first_tail = int(seq_lens.min()) // block_size if query.is_cpu else 0
    values[:, first_tail:].masked_fill_(beyond_end[:, first_tail:].transpose(-1, -2), 0)
    # An empty sequence's max is -inf; clamping it keeps its probabilities 0 (and its output 0) instead of NaN.
    probs = torch.exp(scores - scores.amax(dim=(1, 4), keepdim=True).clamp_min(torch.finfo(torch.float32).min))
    denominator = probs.sum(dim=(1, 4)).unsqueeze(-1).clamp_min(torch.finfo(torch.float32).tiny)
    weighted = torch.matmul(probs.to(compute), values.to(compute)).sum(1, dtype=torch.float32)
    return (weighted / denominator).view(num_seqs, num_q_heads, head_dim).to(query.dtype)


def _chunk_size(query, key_cache, num_blocks_used: int) -> int:
    """Sequences per chunk so one chunk's gathered K and V are about ``GATHER_CHUNK_BYTES``; all at once on CUDA."""
    num_seqs = max(query.shape[0], 1)
    if query.is_cuda:
        return num_seqs
    bytes_per_seq = 2 * num_blocks_used * key_cache[0].numel() * key_cache.element_size()
    return min(num_seqs, max(1, GATHER_CHUNK_BYTES // max(bytes_per_seq, 1)))


def _gather_buffers(key_cache, num_rows: int):
    """Per-thread reusable gather buffers (fresh CPU memory costs a page fault per 4 KiB, more than the copy)."""
    shape = (num_rows, *key_cache.shape[1:])
    if not key_cache.is_cpu:
        return torch.empty(shape, dtype=key_cache.dtype, device=key_cache.device), \
            torch.empty(shape, dtype=key_cache.dtype, device=key_cache.device)
    cache = _buffers.__dict__.setdefault("by_kind", {})
    kind, numel = (key_cache.dtype, tuple(key_cache.shape[1:])), num_rows * key_cache[0].numel()
    if kind not in cache or cache[kind][0].numel() < numel:
        cache.clear()  # keep one buffer pair per thread
        cache[kind] = (torch.empty(numel, dtype=key_cache.dtype), torch.empty(numel, dtype=key_cache.dtype))
    return tuple(buffer[:numel].view(shape) for buffer in cache[kind])


_buffers = threading.local()


def rms_norm(x, weight, eps: float, residual=None):
    """``(normed, residual_out)`` (see ``paged_kernels.rms_norm``), computed as HF's ``Qwen3RMSNorm`` does: in float32,
    the result cast back before the weight multiplies it (so the engine's tokens stay HF's)."""
    total = x if residual is None else x + residual
    hidden = total.to(torch.float32)
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(total.dtype), total


def silu_and_mul(x):
    """``silu(gate) * up`` of ``x = [gate, up]`` along the last axis."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def qk_norm_rope_write(q, k, v, q_weight, k_weight, cos_sin_cache, positions, key_cache, value_cache, slot_mapping,
                       eps: float, kv_cache_dtype: str = "auto", k_scale: float = 1.0, v_scale: float = 1.0):
    """Per-head RMSNorm, rotary from the table, and the cache write of the rotated keys and ``v`` (see
    ``paged_kernels.qk_norm_rope_write``); the arithmetic of HF's ``apply_rotary_pos_emb``."""
    if q.is_cpu and FUSED_CPU:
        fused = _fused_qk_norm_rope_write(q, k, v, q_weight, k_weight, cos_sin_cache, positions, key_cache,
                                          value_cache, slot_mapping, eps, kv_cache_dtype, k_scale, v_scale)
        if fused is not None:
            return fused
    head_dim = q.shape[-1]
    table = cos_sin_cache[positions.to(device=cos_sin_cache.device, dtype=torch.long)]
    cos, sin = table[:, None, :head_dim], table[:, None, head_dim:]

    def rotate(x, weight):
        x = rms_norm(x, weight, eps)[0]
        half = head_dim // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    q_out, k_out = rotate(q, q_weight), rotate(k, k_weight)
    write_kv_cache(k_out, v, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale)
    return q_out, k_out
