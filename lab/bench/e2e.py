"""End-to-end serving benchmark: our paged engine (prefill-first and chunked prefill) vs HF ``generate`` (padded
static batch) vs HF continuous batching (its paged cache), on one fixed mixed-length workload, in one run. Output
tokens/s, TTFT/TPOT medians, peak memory and (engine) the scheduler's share of step time for each (medians over
repeats), plus speed ratios against HF continuous batching."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch

from lab.errors import InputError
from lab.engine import EngineConfig, LLMEngine, SamplingParams
from lab.engine.live import random_requests

SYSTEMS = ("paged-engine", "paged-engine-chunked", "hf-static", "hf-continuous")


@dataclass(slots=True)
class E2EConfig:
    """The workload and the model under test."""

    model: str = "tiny"
    num_requests: int = 64
    prompt_range: tuple[int, int] = (16, 512)
    output_range: tuple[int, int] = (16, 256)
    device: str = "cpu"
    block_size: int = 16
    attention_backend: str = "auto"
    seed: int = 0
    systems: tuple[str, ...] = ("paged-engine", "paged-engine-chunked", "hf-static", "hf-continuous")
    prefill_budget: int = 4096  # max_num_batched_tokens of the prefill-first row (the recorded runs' budget)
    chunk_budget: int = 256  # max_num_batched_tokens of the chunked-prefill row
    repeats: int = 3  # each system runs the workload this many times; the table holds medians


class PeakMemory:
    """Peak device allocation (CUDA) or peak resident set size (CPU, Linux: VmHWM after resetting it)."""

    def __init__(self, device: torch.device):
        self.device = device

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            _reset_rss_peak()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self.peak = status_bytes("VmHWM")


def _reset_rss_peak() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass  # not Linux or not allowed: the peak then covers the whole process


def status_bytes(field: str, pid: int | None = None) -> int:
    """A byte count of ``/proc/<pid>/status`` (``VmHWM``: the peak resident set) of this process or ``pid``; off
    Linux, this process's peak resident set (another process's: 0)."""
    try:
        for line in Path(f"/proc/{pid or 'self'}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    if pid is not None:
        return 0
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_paged_engine(template: LLMEngine, prompts, outputs, **changes) -> dict:
    """A fresh engine (empty prefix cache) on the template's loaded weights, so repeats do not hit earlier runs;
    ``changes`` override its ``EngineConfig`` (e.g. chunked scheduling)."""
    engine = LLMEngine(template.hf_model, template.config, tokenizer=template.tokenizer,
                       num_blocks=template.block_manager.num_physical_blocks, **changes)
    started = time.perf_counter()
    results = engine.generate(prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in outputs])
    wall = time.perf_counter() - started
    table, steps = engine.request_metrics(), engine.step_log()
    return {"wall_s": wall, "output_tokens": sum(len(r.token_ids) for r in results),
            "ttft_median_s": float(table["ttft_s"].median()), "tpot_median_s": float(table["tpot_s"].median()),
            "scheduler_share": engine.scheduler_s / float(steps["duration_s"].sum()),
            "steps": len(steps), "tokens": [r.token_ids for r in results]}


class _StepClock:
    """Logits processor that records when each generation step runs (HF generate gives no per-token times)."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def run_hf_static(model, prompts, outputs, device) -> dict:
    """One padded batch (left padding); it runs until the longest output, useful tokens are the requested ones."""
    from transformers import LogitsProcessorList

    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    clock = _StepClock()
    started = time.perf_counter()
    with torch.no_grad():
        generated = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=max(outputs),
                                   min_new_tokens=max(outputs), do_sample=False, pad_token_id=0,
                                   logits_processor=LogitsProcessorList([clock]))
    wall = time.perf_counter() - started
    steps = [t - started for t in clock.times]
    tpots = [(steps[n - 1] - steps[0]) / max(n - 1, 1) for n in outputs]
    tokens = [generated[row, width:width + n].tolist() for row, n in enumerate(outputs)]
    return {"wall_s": wall, "output_tokens": sum(outputs), "ttft_median_s": steps[0],
            "tpot_median_s": statistics.median(tpots), "tokens": tokens}


def run_hf_continuous(model, prompts, outputs) -> dict:
    """HF continuous batching (``generate_batch``'s manager), one ``max_new_tokens`` per request."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    config = GenerationConfig(max_new_tokens=max(outputs), do_sample=False, eos_token_id=-1, pad_token_id=0)
    hints = WorkloadHints(max_prompt_length=max(len(p) for p in prompts), max_generated_length=max(outputs),
                          num_requests=len(prompts))
    # A KV cache that holds the whole workload at once: sized from free memory instead, it is mostly never used and
    # HF fills its static tensors (attention mask included) over all of it at start-up.
    page = ContinuousBatchingConfig().page_size
    cache = ContinuousBatchingConfig(num_blocks=sum(-(-(len(p) + n) // page) for p, n in zip(prompts, outputs)))
    results = {}
    with model.continuous_batching_context_manager(generation_config=config, block=True, timeout=5,
                                                   workload_hints=hints, continuous_batching_config=cache) as manager:
        started = time.perf_counter()
        ids = [manager.add_request(p, request_id=f"r{i}", max_new_tokens=n, record_timestamps=True)
               for i, (p, n) in enumerate(zip(prompts, outputs))]
        while len(results) < len(ids):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = result
            elif result is None and not manager.is_running():
                raise RuntimeError("HF continuous batching stopped before finishing")
        wall = time.perf_counter() - started
    ordered = [results[i] for i in ids]
    ttfts = [r.timestamps[0] - r.created_time for r in ordered if r.timestamps]
    tpots = [(r.timestamps[-1] - r.timestamps[0]) / max(len(r.timestamps) - 1, 1) for r in ordered if r.timestamps]
    return {"wall_s": wall, "output_tokens": sum(len(r.generated_tokens) for r in ordered),
            "ttft_median_s": statistics.median(ttfts) if ttfts else float("nan"),
            "tpot_median_s": statistics.median(tpots) if tpots else float("nan"),
            "tokens": [list(r.generated_tokens) for r in ordered]}


def run_e2e_bench(config: E2EConfig, progress=None) -> pd.DataFrame:
    """Rows per system; ``same_tokens_as_engine`` checks greedy agreement with the paged engine."""
    unknown = [name for name in config.systems if name not in SYSTEMS]
    if unknown or not config.systems:
        raise InputError(f"systems must be a non-empty subset of {', '.join(SYSTEMS)}; "
                         f"got {', '.join(config.systems) or 'none'}")
    device = torch.device(config.device)
    engine = LLMEngine(config.model, EngineConfig(block_size=config.block_size, device=config.device,
                                                  attention_backend=config.attention_backend,
                                                  max_num_seqs=config.num_requests,
                                                  max_num_batched_tokens=config.prefill_budget))
    prompts, outputs = random_requests(config.num_requests, config.prompt_range, config.output_range,
                                       engine.hf_model.config.vocab_size, config.seed)
    warm_prompts, warm_outputs = prompts[:2], [4, 4]
    runners = {"paged-engine": lambda p, o: run_paged_engine(engine, p, o),
               "paged-engine-chunked": lambda p, o: run_paged_engine(
                   engine, p, o, scheduling="chunked", max_num_batched_tokens=config.chunk_budget),
               "hf-static": lambda p, o: run_hf_static(engine.hf_model, p, o, device),
               "hf-continuous": lambda p, o: run_hf_continuous(engine.hf_model, p, o)}
    rows, reference = [], None
    for done, name in enumerate(config.systems, 1):
        runners[name](warm_prompts, warm_outputs)  # warm-up: allocator, kernels, lazy imports
        repeats = []
        for _ in range(config.repeats):
            with PeakMemory(device) as memory:
                result = runners[name](prompts, outputs)
            repeats.append({**result, "peak_memory_mib": memory.peak / 2**20})
        tokens = repeats[0].pop("tokens")
        reference = reference if reference is not None else tokens
        row = {key: statistics.median(r[key] for r in repeats) for key in repeats[0] if key != "tokens"}
        rows.append({"system": name, **row, "output_tok_s": row["output_tokens"] / row["wall_s"],
                     "same_tokens_as_engine": tokens == reference, "repeats": config.repeats})
        if progress:
            progress(done, len(config.systems))
    table = pd.DataFrame(rows)
    if "hf-continuous" in set(table["system"]):
        base = float(table.loc[table["system"] == "hf-continuous", "output_tok_s"].iloc[0])
        table["speedup_vs_hf_continuous"] = table["output_tok_s"] / base
    table["model"], table["device"], table["num_requests"] = config.model, config.device, config.num_requests
    return table


def _e2e_for_detached(config: E2EConfig, report) -> pd.DataFrame:
    return run_e2e_bench(config, progress=lambda done, total: report(("progress", done, total)))


def run_e2e_bench_detached(config: E2EConfig, progress=None) -> pd.DataFrame:
    """``run_e2e_bench(config)``, what ``python -m lab bench e2e`` runs, in a process of its own
    (``lab.engine.detached``: the app's comparisons, away from the Streamlit server); ``progress(done, total)`` after
    each system."""
    from lab.engine.detached import run_detached

    return run_detached(_e2e_for_detached, config,
                        None if progress is None else lambda message: progress(*message[1:]))
