"""Decode step time per batch and context: the engine's own step, with and without CUDA graphs.

For each (batch, context) the engine prefills ``batch`` prompts of ``context`` tokens, then times decode steps
(the device synchronized before each clock read) and reports the median; on CUDA the same with ``cuda_graphs`` off,
alternating, and the kernels one decode step launches as the torch profiler sees them.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import pandas as pd
import torch

from lab.engine.llm_engine import EngineConfig, LLMEngine, SamplingParams, load_model
from lab.errors import InputError
from paged_kernels.torch_backend import synchronize


@dataclass(slots=True)
class DecodeBenchConfig:
    model: str = "tiny"
    device: str = "cpu"
    batches: tuple[int, ...] = (1, 8, 64)
    contexts: tuple[int, ...] = (512, 4096)
    block_size: int = 16
    attention_backend: str = "auto"
    steps: int = 20  # decode steps timed per case (median)


def run_decode_bench(config: DecodeBenchConfig, on_row: Callable[[pd.DataFrame], None] | None = None) -> pd.DataFrame:
    """One row per (batch, context, graphs): the median decode step in ms, the spread, and on CUDA the kernels
    launched by one decode step. The engine is the one e2e, the twin and the app run (its default
    ``max_model_len``, so graphs partition attention as theirs do); ``cuda_graphs`` says whether its decode steps
    replayed graphs (the self-check may have turned them off). ``on_row(rows so far)`` after each row, so that a
    crash later loses nothing measured."""
    if not config.batches or not config.contexts:
        raise InputError("give at least one batch size and one context length")
    base = EngineConfig(block_size=config.block_size, device=config.device,
                        attention_backend=config.attention_backend, max_num_seqs=max(config.batches))
    hf_model, tokenizer = load_model(config.model, base)
    on_gpu = torch.device(config.device).type == "cuda"
    rows = []
    for context in config.contexts:
        for batch in config.batches:
            blocks = batch * (-(-(context + config.steps + 2) // config.block_size)) + 1
            for graphs in ((True, False) if on_gpu else (False,)):
                engine = LLMEngine(hf_model, base, tokenizer=tokenizer, num_blocks=blocks, cuda_graphs=graphs)
                timed = _time_decode(engine, batch, context, config.steps, on_gpu)
                static = engine.runner.static_decode
                rows.append({"model": config.model, "device": config.device, "batch": batch, "context": context,
                             "cuda_graphs": bool(graphs and static is not None and static.use_graphs), **timed})
                if on_row is not None:
                    on_row(pd.DataFrame(rows))
    return pd.DataFrame(rows)


def _time_decode(engine: LLMEngine, batch: int, context: int, steps: int, on_gpu: bool) -> dict:
    generator = torch.Generator().manual_seed(batch + context)
    vocab = engine.hf_model.config.vocab_size
    for _ in range(batch):
        engine.add_request(torch.randint(0, vocab, (context,), generator=generator).tolist(),
                           SamplingParams(max_tokens=steps + 2, ignore_eos=True))
    while engine.scheduler.waiting or engine.scheduler.prefilling:
        engine.step()  # the prefills
    engine.step()
    times = []
    for _ in range(steps - 1):
        synchronize(engine.device)
        started = time.perf_counter()
        engine.step()
        synchronize(engine.device)
        times.append(time.perf_counter() - started)
    launches = _kernels_per_step(engine) if on_gpu and engine.has_unfinished() else float("nan")
    return {"step_ms": 1e3 * statistics.median(times), "step_ms_min": 1e3 * min(times),
            "step_ms_max": 1e3 * max(times), "kernels_per_step": launches}


def _kernels_per_step(engine: LLMEngine) -> int:
    """CUDA kernels one decode step runs, counted by the torch profiler (a graph replay's kernels included)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.step()
        synchronize(engine.device)
    return sum(1 for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA)
