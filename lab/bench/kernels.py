"""Paged decode attention vs SDPA on the same K/V laid out contiguously, plus achieved KV bandwidth.

CPU: the torch backend (the goal is paged / SDPA <= 1.2 at batch 32, context 1024, 16/8 heads, head_dim 128).
GPU: torch and cupy backends (v1 and v2) at batch 1/8/64 x context 512/4096/32768, block 16, against a measured
device-to-device copy bandwidth (goal: >= 85 % of it at batch 64 x 4096).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from dataclasses import replace as dataclass_replace

import pandas as pd
import torch

import paged_kernels
from lab.bench.timing import Timing, median_seconds, time_calls
from lab.errors import LabError


@dataclass(slots=True)
class KernelBenchConfig:
    """One sweep: shapes, backends and repeat count."""

    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    batch_sizes: tuple[int, ...] = (1, 8, 32)
    context_lens: tuple[int, ...] = (512, 1024)
    num_q_heads: int = 16
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    backends: tuple[str, ...] = ("torch",)
    repeats: int = 10
    shapes: tuple[tuple[int, int], ...] = ()  # (batch, context) pairs; empty: every batch size x context length
    back_to_back: int = 1  # calls per timed sample (a GPU's time per call without the host's launch gaps)

    def shape_list(self) -> list[tuple[int, int]]:
        return list(self.shapes) or [(b, c) for b in self.batch_sizes for c in self.context_lens]


def make_paged_inputs(batch: int, context: int, config: KernelBenchConfig, seed: int = 0):
    """Query, shuffled paged caches, block tables, seq_lens and the same K/V contiguous ``[B, Hkv, L, D]``."""
    generator = torch.Generator(device=config.device).manual_seed(seed)
    blocks_per_seq = -(-context // config.block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, config.num_kv_heads, config.block_size, config.head_dim)
    options = dict(device=config.device, dtype=config.dtype, generator=generator)
    key_cache, value_cache = torch.randn(shape, **options), torch.randn(shape, **options)
    order = torch.randperm(num_blocks, device=config.device, generator=generator)
    block_tables = order.view(batch, blocks_per_seq).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=config.device)
    query = torch.randn((batch, config.num_q_heads, config.head_dim), **options)
    contiguous = [contiguous_kv(cache, block_tables, context) for cache in (key_cache, value_cache)]
    return query, key_cache, value_cache, block_tables, seq_lens, contiguous


def contiguous_kv(cache, block_tables, context: int):
    from paged_kernels.torch_backend import gather_kv

    return gather_kv(cache, block_tables.long(), block_tables.shape[1])[:, :, :context].contiguous()


def sdpa_decode(query, keys, values):
    """Baseline: torch SDPA with GQA on contiguous K/V."""
    batch, heads, dim = query.shape
    return torch.nn.functional.scaled_dot_product_attention(query.view(batch, heads, 1, dim), keys, values,
                                                            enable_gqa=True)


def copy_bandwidth(device: str, num_bytes: int = 1 << 30) -> float:
    """Measured device copy bandwidth in bytes/s (read + write)."""
    src = torch.empty(num_bytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), repeats=10, cuda=device != "cpu")
    return 2 * num_bytes / seconds


def bench_one(batch: int, context: int, config: KernelBenchConfig) -> list[dict]:
    """Rows for every backend (and the SDPA baseline) at one shape."""
    query, key_cache, value_cache, block_tables, seq_lens, (keys, values) = make_paged_inputs(batch, context, config)
    cuda = config.device != "cpu"
    kv_bytes = 2 * batch * context * config.num_kv_heads * config.head_dim * key_cache.element_size()
    sdpa = time_calls(lambda: sdpa_decode(query, keys, values), config.repeats, cuda=cuda,
                      back_to_back=config.back_to_back)
    rows = [_row("sdpa-contiguous", batch, context, sdpa, sdpa.median, kv_bytes, 0.0)]
    expected = sdpa_decode(query, keys, values).view_as(query).float()
    for backend in config.backends:
        for variant, call in _variants(backend, query, key_cache, value_cache, block_tables, seq_lens):
            timing = time_calls(call, config.repeats, cuda=cuda, back_to_back=config.back_to_back)
            error = float(((call().float() - expected).abs().max() / expected.abs().max()).item())
            rows.append(_row(variant, batch, context, timing, sdpa.median, kv_bytes, error))
    return rows


def _variants(backend, query, key_cache, value_cache, block_tables, seq_lens):
    """Each call as the engine makes it: unchecked, the longest length given from the host."""
    args, longest = (query, key_cache, value_cache, block_tables, seq_lens), int(seq_lens.max())
    if backend != "cupy":
        yield backend, lambda: paged_kernels.paged_attention_decode(*args, backend=backend, check=False,
                                                              max_seq_len=longest)
        return
    from paged_kernels import cupy_backend

    scale = query.shape[-1] ** -0.5
    yield "cupy-auto", lambda: paged_kernels.paged_attention_decode(*args, backend="cupy", check=False,
                                                              max_seq_len=longest)
    yield "cupy-v1", lambda: cupy_backend.paged_attention_decode(*args, scale, partition_size=0, max_seq_len=longest)
    yield "cupy-v2", lambda: cupy_backend.paged_attention_decode(*args, scale, partition_size=512,
                                                                 max_seq_len=longest)


def _row(kernel, batch, context, timing: Timing, sdpa_seconds, kv_bytes, error) -> dict:
    """One timed call: its median and spread (fastest, slowest of the repeats) in ms, against SDPA's median."""
    return {"kernel": kernel, "batch": batch, "context": context, "median_ms": timing.median * 1e3,
            "min_ms": timing.low * 1e3, "max_ms": timing.high * 1e3, "vs_sdpa": timing.median / sdpa_seconds,
            "kv_gb_per_s": kv_bytes / timing.median / 1e9, "max_rel_err": error}


class KernelBenchError(LabError):
    """A kernel sweep's baseline is not trustworthy (see ``check_baseline``)."""


WARM_UP_S = 0.5  # per call kind, at most: the first calls of a process pay for thread pools, lazy init, page faults


def warm_up(config: KernelBenchConfig, max_seconds: float = WARM_UP_S) -> None:
    """Run SDPA and every backend on the sweep's first shape until their times settle (two medians of 5 calls
    within 10 % of each other) or ``max_seconds`` pass, so the first timed shape is not the one paying for them."""
    batch, context = config.shape_list()[0]
    query, key_cache, value_cache, block_tables, seq_lens, (keys, values) = make_paged_inputs(batch, context, config)
    calls = [lambda: sdpa_decode(query, keys, values)]
    for backend in config.backends:
        calls += [call for _, call in _variants(backend, query, key_cache, value_cache, block_tables, seq_lens)]
    cuda = config.device != "cpu"
    for call in calls:
        started, previous = time.perf_counter(), math.inf
        while time.perf_counter() - started < max_seconds:
            current = median_seconds(call, repeats=5, warmup=1, cuda=cuda)
            if abs(current - previous) <= 0.1 * previous:
                break
            previous = current


MONOTONE_SLACK = 0.7  # a longer context's baseline may read this fraction of a shorter one's before it is refused


def baseline_problem(table: pd.DataFrame) -> str | None:
    """Why the SDPA baseline cannot be trusted, or None: it got faster as the context grew at a batch size (by more
    than noise, ``MONOTONE_SLACK``). More KV to read cannot take less time, so such a run mismeasured (a missing
    warm-up made exactly this: 5-8 ms at the first shape against 0.05 ms alone)."""
    sdpa = table[table["kernel"] == "sdpa-contiguous"].sort_values(["batch", "context"])
    for batch, rows in sdpa.groupby("batch"):
        times, contexts = rows["median_ms"].to_numpy(), rows["context"].to_numpy()
        for i in range(1, len(times)):
            if times[i] < MONOTONE_SLACK * times[:i].max():
                j = int(times[:i].argmax())
                return (f"the SDPA baseline at batch {batch} took {times[j]:.3g} ms at context {contexts[j]} but "
                        f"{times[i]:.3g} ms at context {contexts[i]}: a noisy or unwarmed run")
    return None


def check_baseline(table: pd.DataFrame) -> None:
    """Raise ``KernelBenchError`` when the SDPA baseline cannot be trusted (``baseline_problem``)."""
    problem = baseline_problem(table)
    if problem:
        raise KernelBenchError(f"{problem}; run it again on a quieter machine")


def retime_baseline(table: pd.DataFrame, config: KernelBenchConfig, rounds: int = 3) -> None:
    """Time the SDPA rows of ``table`` again in place: ``rounds`` passes over the shapes in turn (so a slow spell
    touches them all alike), each shape's median over its passes."""
    cuda = config.device != "cpu"
    sdpa = table.index[table["kernel"] == "sdpa-contiguous"]
    calls = {}
    for index in sdpa:
        batch, context = int(table.at[index, "batch"]), int(table.at[index, "context"])
        query, _, _, _, _, (keys, values) = make_paged_inputs(batch, context, config)
        calls[index] = lambda query=query, keys=keys, values=values: sdpa_decode(query, keys, values)
    times = {index: [] for index in calls}
    for _ in range(rounds):
        for index, call in calls.items():
            times[index].append(median_seconds(call, config.repeats, cuda=cuda))
    for index, samples in times.items():
        seconds = sorted(samples)[len(samples) // 2]
        kv_bytes = table.at[index, "kv_gb_per_s"] * table.at[index, "median_ms"] * 1e6  # GB/s x ms
        table.at[index, "median_ms"] = seconds * 1e3
        table.at[index, "min_ms"], table.at[index, "max_ms"] = min(samples) * 1e3, max(samples) * 1e3  # of medians
        table.at[index, "kv_gb_per_s"] = kv_bytes / seconds / 1e9
    for index in table.index[table["kernel"] != "sdpa-contiguous"]:
        same = sdpa[(table.loc[sdpa, "batch"] == table.at[index, "batch"])
                    & (table.loc[sdpa, "context"] == table.at[index, "context"])]
        table.at[index, "vs_sdpa"] = table.at[index, "median_ms"] / table.loc[same[0], "median_ms"]


def run_kernel_bench(config: KernelBenchConfig, progress=None, on_rows=None, refuse_noisy: bool = True) -> pd.DataFrame:
    """Warm up, run the sweep and check its baseline, timing it again once if it fails (``check_baseline``);
    ``progress(done, total)`` is called after each shape, ``on_rows(rows so far)`` too (unchecked: a crash later
    keeps what was measured). ``refuse_noisy=False`` returns a baseline that still fails, for the caller to show
    with ``baseline_problem``'s warning (the app), instead of raising (the recorded benchmark)."""
    shapes = config.shape_list()
    warm_up(config)
    rows = []
    for done, (batch, context) in enumerate(shapes, 1):
        rows += bench_one(batch, context, config)
        if progress:
            progress(done, len(shapes))
        if on_rows:
            on_rows(pd.DataFrame(rows))
    table = pd.DataFrame(rows)
    try:
        check_baseline(table)
    except KernelBenchError:  # one disturbed timing: measure the baseline again, all shapes, before refusing
        retime_baseline(table, config)
        if refuse_noisy:
            check_baseline(table)
    table["device"], table["dtype"] = config.device, str(config.dtype).replace("torch.", "")
    table["block_size"] = config.block_size
    if config.device != "cpu":
        table["copy_gb_per_s"] = copy_bandwidth(config.device) / 1e9
        table["frac_of_copy_bw"] = table["kv_gb_per_s"] / table["copy_gb_per_s"]
    return table


def check_against_reference(config: KernelBenchConfig, context: int = 300, batch: int = 3) -> pd.DataFrame:
    """Max relative error of each backend against the float64 NumPy reference on a small shape of the config's
    heads and block size (context not a multiple of the block size)."""
    from paged_kernels import reference

    query, key_cache, value_cache, block_tables, seq_lens, _ = make_paged_inputs(batch, context, config, seed=1)
    seq_lens = torch.tensor([context, context // 2 + 1, 1][:batch] + [context] * max(0, batch - 3),
                            dtype=torch.int32, device=config.device)
    as_numpy = [t.double().cpu().numpy() for t in (query, key_cache, value_cache)]
    expected = reference.paged_attention_decode(*as_numpy, block_tables.cpu().numpy(), seq_lens.cpu().numpy(),
                                                config.head_dim ** -0.5)
    rows = []
    for backend in config.backends:
        out = paged_kernels.paged_attention_decode(query, key_cache, value_cache, block_tables, seq_lens,
                                                   backend=backend)
        error = float(abs(out.double().cpu().numpy() - expected).max() / abs(expected).max())
        rows.append({"backend": backend, "dtype": str(config.dtype).replace("torch.", ""), "max_rel_err": error})
    return pd.DataFrame(rows)


PRECISION_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")


def run_precision_bench(config: KernelBenchConfig, kv_cache_dtypes: tuple[str, ...] = PRECISION_DTYPES,
                        context: int = 300, batch: int = 3, backend: str = "torch") -> pd.DataFrame:
    """The decode kernel over a full-precision cache (``auto``: the config's dtype) and FP8 caches (scale 1.0), on
    ``backend`` (torch by default; ``cupy``: the CUDA kernels, FP8 instances included): per cache precision and sweep shape the median time and the K/V bytes read; and on a small
    shape (``batch`` x ``context``, the config's heads and block size) two errors against the float64 reference:
    ``kernel_rel_err`` over what the cache holds (the dequantized K/V: the kernel's own arithmetic) and
    ``rel_err_vs_fp64`` over the K/V before they were stored (what the precision costs, the kernel's error with it).
    Errors are max |out - expected| / max |expected|."""
    from paged_kernels import reference
    from paged_kernels.torch_backend import quantize

    cuda = config.device != "cpu"

    def stored(key_cache, value_cache, kv_cache_dtype):
        if kv_cache_dtype == "auto":
            return key_cache, value_cache, {}
        return (quantize(key_cache, 1.0, kv_cache_dtype), quantize(value_cache, 1.0, kv_cache_dtype),
                dict(kv_cache_dtype=kv_cache_dtype, k_scale=1.0, v_scale=1.0))

    rows = []
    full = dataclass_replace(config, dtype=torch.float64 if not cuda else config.dtype)
    query, key_cache, value_cache, block_tables, seq_lens, _ = make_paged_inputs(batch, context, full, seed=2)
    seq_lens = torch.tensor([context, context // 2 + 1, 1][:batch] + [context] * max(0, batch - 3),
                            dtype=torch.int32, device=config.device)
    truth = reference.paged_attention_decode(*(t.double().cpu().numpy() for t in (query, key_cache, value_cache)),
                                             block_tables.cpu().numpy(), seq_lens.cpu().numpy(),
                                             config.head_dim ** -0.5)
    errors = {}
    for kv_cache_dtype in kv_cache_dtypes:
        keys, values, precision = stored(key_cache.to(config.dtype), value_cache.to(config.dtype), kv_cache_dtype)
        out = paged_kernels.paged_attention_decode(query.to(config.dtype), keys, values, block_tables, seq_lens,
                                                   backend=backend, **precision)
        as_stored = (lambda t: t.cpu().numpy()) if precision else (lambda t: t.double().cpu().numpy())
        held = paged_kernels.paged_attention_decode(query.double().cpu().numpy(), as_stored(keys), as_stored(values),
                                                    block_tables.cpu().numpy(), seq_lens.cpu().numpy(),
                                                    backend="reference", **precision)
        got = out.double().cpu().numpy()
        errors[kv_cache_dtype] = (float(abs(got - held).max() / abs(held).max()),
                                  float(abs(got - truth).max() / abs(truth).max()))
    for batch_size, context_len in config.shape_list():
        query, key_cache, value_cache, block_tables, seq_lens, _ = make_paged_inputs(batch_size, context_len, config)
        for kv_cache_dtype in kv_cache_dtypes:
            keys, values, precision = stored(key_cache, value_cache, kv_cache_dtype)
            call = lambda: paged_kernels.paged_attention_decode(query, keys, values, block_tables, seq_lens,  # noqa: E731
                                                                backend=backend, check=False,
                                                                max_seq_len=context_len, **precision)
            median_seconds(call, repeats=3, cuda=cuda)  # warm (first calls build tables, fault pages in)
            timing = time_calls(call, config.repeats, cuda=cuda)
            kv_bytes = 2 * batch_size * context_len * config.num_kv_heads * config.head_dim * keys.element_size()
            rows.append({"kv_cache_dtype": kv_cache_dtype, "dtype": str(config.dtype).replace("torch.", ""),
                         "batch": batch_size, "context": context_len, "median_ms": timing.median * 1e3,
                         "kv_bytes": kv_bytes, "kv_gb_per_s": kv_bytes / timing.median / 1e9,
                         "kernel_rel_err": errors[kv_cache_dtype][0], "rel_err_vs_fp64": errors[kv_cache_dtype][1]})
    table = pd.DataFrame(rows)
    auto = table[table["kv_cache_dtype"] == "auto"].set_index(["batch", "context"])["median_ms"]
    table["vs_auto"] = [row.median_ms / auto.get((row.batch, row.context), float("nan")) for row in table.itertuples()]
    return table[["kv_cache_dtype", "batch", "context", "median_ms", "vs_auto", "rel_err_vs_fp64", "kernel_rel_err",
                  "kv_bytes", "kv_gb_per_s", "dtype"]]
