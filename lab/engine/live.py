"""Live runtime runs for dashboards: a synthetic request mix through ``LLMEngine`` with per-step callbacks and
block-pool frames."""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from dataclasses import replace as dataclasses_replace
from typing import Callable

import pandas as pd
import torch

from lab.errors import InputError
from lab.kv_cache.pool_view import PoolSnapshot
from .llm_engine import EngineConfig, LLMEngine, SamplingParams, StepStats


def _runtime_engine_defaults() -> EngineConfig:
    return EngineConfig(num_blocks=256, max_num_seqs=32)


@dataclass(slots=True)
class RuntimeRunConfig:
    """A request mix (seeded: prompts, output lengths and sampling) and the engine settings to serve it with."""

    model: str = "tiny"
    num_requests: int = 16
    prompt_len_range: tuple[int, int] = (16, 128)
    max_tokens_range: tuple[int, int] = (16, 64)
    shared_prefix_tokens: int = 0
    n: int = 1
    temperature: float = 0.0
    seed: int = 0
    engine: EngineConfig = field(default_factory=_runtime_engine_defaults)


@dataclass(slots=True)
class RuntimeRun:
    """Per-request metrics, run totals, per-step stats and (every few steps) block-pool frames."""

    requests: pd.DataFrame
    summary: dict
    steps: pd.DataFrame  # StepStats' columns, then kv_cache_usage, prefix_cache_hit_rate, num_preemptions_total
    frames: list[tuple[StepStats, PoolSnapshot]] = field(default_factory=list)
    stopped: bool = False
    tokens: pd.DataFrame = field(default_factory=pd.DataFrame)  # seq_id, request_id, t_s: when each token came
    scheduled: dict = field(default_factory=dict)  # request id -> when its prompt's first chunk ran (s)


def throttled(callback: Callable[..., object], interval_s: float,
              clock: Callable[[], float] = time.perf_counter) -> Callable[..., None]:
    """``callback`` passed on at most once per ``interval_s`` (the first call always), for progress bars and live
    charts: each redraw costs the browser and the app server CPU time that the work being measured then loses. On a
    2-vCPU machine, calibrating on the twin page with its bar redrawn after every scenario (about 9 a second) fitted
    step times 13-20 % above what the engine then ran at (throughput, three runs); redrawn every 2 s (and with a static
    note, not a spinner, during the runs it predicts), within -15 to +11 % in eight runs, the rest being the browser
    sharing the CPUs."""
    last = [-math.inf]

    def call(*args, **kwargs) -> None:
        now = clock()
        if now - last[0] >= interval_s:
            last[0] = now
            callback(*args, **kwargs)
    return call


def random_requests(num_requests: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
                    vocab_size: int, seed: int = 0, shared_prefix_tokens: int = 0) -> tuple[list[list[int]], list[int]]:
    """Seeded prompts (a shared prefix, then random tokens of a uniform length) and per-request output lengths."""
    for name, (low, high) in (("prompt", prompt_range), ("output", output_range)):
        if not 1 <= low <= high:
            raise InputError(f"{name} length range must satisfy 1 <= low <= high; got {(low, high)}")
    generator = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, vocab_size, (shared_prefix_tokens,), generator=generator).tolist()
    lengths = torch.randint(prompt_range[0], prompt_range[1] + 1, (num_requests,), generator=generator)
    outputs = torch.randint(output_range[0], output_range[1] + 1, (num_requests,), generator=generator).tolist()
    prompts = [prefix + torch.randint(0, vocab_size, (int(n),), generator=generator).tolist() for n in lengths]
    return prompts, outputs


def run_runtime(config: RuntimeRunConfig,
                on_step: Callable[[StepStats, PoolSnapshot | None], bool | None] | None = None,
                frame_every: int = 1, hf_model=None, tokenizer=None) -> RuntimeRun:
    """Serve the request mix; ``on_step(stats, pool_or_None)`` after each step (the pool every ``frame_every``
    steps, never when 0, with ``pool.host_pool`` when swapping) may return False to stop early. ``hf_model`` reuses an already
    loaded model."""
    steps, frames, extra, tokens, scheduled = [], [], [], [], {}
    engine = LLMEngine(hf_model if hf_model is not None else config.model, config.engine,
                       tokenizer=tokenizer)
    origin, cache, preemptions = engine.started_s, engine.block_manager.prefix_cache_stats, 0
    prompts, max_tokens = random_requests(config.num_requests, config.prompt_len_range, config.max_tokens_range,
                                          engine.hf_model.config.vocab_size, config.seed, config.shared_prefix_tokens)
    for prompt, limit in zip(prompts, max_tokens):
        engine.add_request(prompt, SamplingParams(max_tokens=limit, temperature=config.temperature, n=config.n,
                                                  seed=config.seed, ignore_eos=True))
    stopped = False
    while engine.has_unfinished() and not stopped:
        engine.step()
        stats = engine.last_step_stats()
        steps.append(stats)
        preemptions += stats.num_preempted + stats.num_swapped_out
        extra.append((stats.blocks_in_use / engine.block_manager.num_physical_blocks, cache.hit_rate, preemptions))
        _record_times(engine.last_plan, stats.elapsed_s - stats.duration_s, stats.elapsed_s, tokens, scheduled)
        pool = engine.pool_snapshot() if frame_every and engine.num_steps % frame_every == 0 else None
        if pool is not None:
            frames.append((stats, pool))
        if on_step is not None:
            stopped = on_step(stats, pool) is False
    step_table = pd.DataFrame([asdict(s) for s in steps])
    step_table[["kv_cache_usage", "prefix_cache_hit_rate", "num_preemptions_total"]] = pd.DataFrame(
        extra, columns=["kv_cache_usage", "prefix_cache_hit_rate", "num_preemptions_total"], index=step_table.index)
    requests = engine.request_metrics()
    if len(requests):
        outputs = {o.request_id: o for o in engine.finished}
        # the run's clock: seconds since the engine started (the step table's elapsed_s)
        requests["arrival_s"] = [outputs[i].arrival_s - origin for i in requests["request_id"]]
        requests["scheduled_s"] = [scheduled.get(i, math.nan) for i in requests["request_id"]]
        requests["first_token_s"] = [outputs[i].first_token_s - origin for i in requests["request_id"]]
        requests["finish_s"] = [outputs[i].finish_s - origin for i in requests["request_id"]]
        if engine.tokenizer is not None:
            requests["output_text"] = [outputs[i].text for i in requests["request_id"]]
    return RuntimeRun(requests, engine.run_metrics(), step_table, frames, stopped,
                      pd.DataFrame(tokens, columns=["seq_id", "request_id", "t_s"]), scheduled)


def _record_times(plan, started_s: float, ended_s: float, tokens: list, scheduled: dict) -> None:
    """From a step's plan (seconds since the engine started): when each request's prompt first ran (``scheduled``)
    and which sequences got a token at the step's end (``tokens``: (seq_id, request_id, t_s))."""
    for chunk in plan.prefill_chunks:
        scheduled.setdefault(chunk.seq.data.request.request_id, started_s)
    for seq in (*plan.prefill_done, *(plan.decode_seqs or ())):
        tokens.append((seq.seq_id, seq.data.request.request_id, ended_s))



def _runtime_for_detached(config: RuntimeRunConfig, report) -> RuntimeRun:
    return run_runtime(config, on_step=lambda stats, pool: report(("step", stats)), frame_every=0)


def run_runtime_detached(config: RuntimeRunConfig,
                         on_step: Callable[[StepStats], bool | None] | None = None) -> RuntimeRun:
    """``run_runtime(config)`` in a process of its own (``lab.engine.detached``: the app's runs, away from the
    Streamlit server and its threads); ``on_step(stats)`` after each step may return False to stop early (the run
    sees it at its next step, so it may have run ahead a step or more). Its ``RuntimeRun`` has no pool frames. A
    checkpoint that cannot be read fails here, before a process starts (``check_model``)."""
    from lab.models.qwen3 import check_model

    from .detached import run_detached

    check_model(config.model)
    return run_detached(_runtime_for_detached, config,
                        None if on_step is None else lambda message: on_step(message[1]))


def compare_kv_precision(config: RuntimeRunConfig, kv_cache_dtype: str = "fp8_e4m3",
                         calculate_kv_scales: bool = False, hf_model=None, tokenizer=None) -> pd.DataFrame:
    """The request mix served greedily twice on the same engine settings and pool: with the model's dtype in the KV
    cache (``auto``) and with ``kv_cache_dtype``, each after a short warm-up request. One row each: output tokens/s
    (of the mix, warm-up excluded), peak blocks in use of the pool (warm-up included: it is smaller), the
    bytes a block holds and the peak KV bytes, and the agreement with the ``auto`` run: ``token_agreement`` (output
    tokens equal position by position: a sequence that parts at a near tie differs from there on) and
    ``first_token_agreement``. Sampling is greedy whatever ``config.temperature`` says (agreement of draws means
    nothing)."""
    if kv_cache_dtype == "auto":
        raise InputError("compare_kv_precision: choose an FP8 kv_cache_dtype to compare with 'auto'")
    runs = {}
    for dtype, calculated in (("auto", False), (kv_cache_dtype, calculate_kv_scales)):
        engine_config = dataclasses_replace(config.engine, kv_cache_dtype=dtype, calculate_kv_scales=calculated)
        engine = LLMEngine(hf_model if hf_model is not None else config.model, engine_config, tokenizer=tokenizer)
        prompts, max_tokens = random_requests(config.num_requests, config.prompt_len_range, config.max_tokens_range,
                                              engine.hf_model.config.vocab_size, config.seed,
                                              config.shared_prefix_tokens)
        # a short request first, so that one-time costs (the CPU extension's load, first-touch memory) fall on
        # neither timed run
        engine.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True))
        started = time.perf_counter()
        outputs = engine.generate(prompts, [SamplingParams(max_tokens=m, n=config.n, ignore_eos=True)
                                            for m in max_tokens])
        elapsed = time.perf_counter() - started
        metrics = engine.run_metrics()
        runner = engine.runner
        per_block = runner.kv_bytes_per_block(engine.hf_model.config, engine.block_size, runner.dtype, dtype)
        runs[dtype] = ([sample for o in outputs for sample in o.outputs],
                       {"kv_cache_dtype": dtype, "scales": "calculated" if calculated else
                        ("-" if dtype == "auto" else "1.0"), "output_tok_s": sum(map(len, (s for o in outputs for s in o.outputs))) / elapsed,
                        "peak_kv_blocks": metrics["peak_kv_blocks"], "num_kv_blocks": metrics["num_kv_blocks"],
                        "kv_bytes_per_block": per_block, "peak_kv_bytes": per_block * metrics["peak_kv_blocks"],
                        "preemptions": metrics["preemptions"]})
    base = runs["auto"][0]
    rows = []
    for samples, row in runs.values():
        same = sum(a == b for x, y in zip(base, samples) for a, b in zip(x, y))
        total = sum(len(x) for x in base)
        rows.append({**row, "first_token_agreement": sum(x[:1] == y[:1] for x, y in zip(base, samples)) / len(base),
                     "token_agreement": same / total if total else float("nan")})
    return pd.DataFrame(rows)


def _precision_for_detached(payload: tuple, report) -> pd.DataFrame:
    config, kv_cache_dtype, calculate_kv_scales = payload
    return compare_kv_precision(config, kv_cache_dtype, calculate_kv_scales)


def compare_kv_precision_detached(config: RuntimeRunConfig, kv_cache_dtype: str = "fp8_e4m3",
                                  calculate_kv_scales: bool = False) -> pd.DataFrame:
    """``compare_kv_precision`` in a process of its own, as the page's other runs (``run_runtime_detached``)."""
    from lab.models.qwen3 import check_model

    from .detached import run_detached

    check_model(config.model)
    return run_detached(_precision_for_detached, (config, kv_cache_dtype, calculate_kv_scales))
