"""Live runtime runs for dashboards: a synthetic request mix through ``LLMEngine`` with per-step callbacks and
block-pool frames."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable

import pandas as pd
import torch

from .block_manager import PoolSnapshot
from .engine import LLMEngine, SamplingParams, StepStats


@dataclass(slots=True)
class RuntimeRunConfig:
    """A request mix and the engine settings to serve it with."""

    model: str = "tiny"
    num_requests: int = 16
    prompt_len_range: tuple[int, int] = (16, 128)
    max_tokens_range: tuple[int, int] = (16, 64)
    shared_prefix_tokens: int = 0
    block_size: int = 16
    num_blocks: int = 256
    enable_prefix_caching: bool = True
    n: int = 1
    temperature: float = 0.0
    attention_backend: str = "auto"
    max_num_seqs: int = 32
    seed: int = 0


@dataclass(slots=True)
class RuntimeRun:
    """Per-request metrics, run totals, per-step stats and (every few steps) block-pool frames."""

    requests: pd.DataFrame
    summary: dict
    steps: pd.DataFrame
    frames: list[tuple[StepStats, PoolSnapshot]] = field(default_factory=list)
    stopped: bool = False


def make_requests(config: RuntimeRunConfig, vocab_size: int) -> tuple[list[list[int]], list[int]]:
    """Seeded prompts (a shared prefix, then random tokens) and per-request max_tokens."""
    low, high = config.prompt_len_range
    if not 1 <= low <= high or not 1 <= config.max_tokens_range[0] <= config.max_tokens_range[1]:
        raise ValueError(f"length ranges must satisfy 1 <= low <= high; got prompts {config.prompt_len_range}, "
                         f"max_tokens {config.max_tokens_range}")
    generator = torch.Generator().manual_seed(config.seed)
    prefix = torch.randint(0, vocab_size, (config.shared_prefix_tokens,), generator=generator).tolist()
    prompts, max_tokens = [], []
    for _ in range(config.num_requests):
        length = int(torch.randint(low, high + 1, (1,), generator=generator))
        prompts.append(prefix + torch.randint(0, vocab_size, (length,), generator=generator).tolist())
        max_tokens.append(int(torch.randint(config.max_tokens_range[0], config.max_tokens_range[1] + 1, (1,),
                                            generator=generator)))
    return prompts, max_tokens


def run_runtime(config: RuntimeRunConfig, on_step: Callable[[StepStats, PoolSnapshot | None], bool | None] | None = None,
                frame_every: int = 1, hf_model=None, tokenizer=None) -> RuntimeRun:
    """Serve the request mix; ``on_step(stats, pool_or_None)`` after each step (the pool every ``frame_every``
    steps) may return False to stop early. ``hf_model`` reuses an already loaded model."""
    steps, frames = [], []
    engine = LLMEngine(hf_model if hf_model is not None else config.model, tokenizer=tokenizer,
                       block_size=config.block_size, num_blocks=config.num_blocks,
                       attention_backend=config.attention_backend, enable_prefix_caching=config.enable_prefix_caching,
                       max_num_seqs=config.max_num_seqs, seed=config.seed)
    prompts, max_tokens = make_requests(config, engine.hf_model.config.vocab_size)
    for prompt, limit in zip(prompts, max_tokens):
        engine.add_request(prompt, SamplingParams(max_tokens=limit, temperature=config.temperature, n=config.n,
                                                  seed=config.seed, ignore_eos=True))
    stopped = False
    while engine.has_unfinished() and not stopped:
        engine.step()
        stats = engine.last_step_stats()
        steps.append(stats)
        pool = engine.block_manager.snapshot() if engine.num_steps % frame_every == 0 else None
        if pool is not None:
            frames.append((stats, pool))
        if on_step is not None:
            stopped = on_step(stats, pool) is False
    step_table = pd.DataFrame([asdict(s) for s in steps])
    return RuntimeRun(engine.request_metrics(), engine.run_metrics(), step_table, frames, stopped)

