"""Frames of the physical block pool over a run, from the simulator or from the real engine, for the block-pool
page's player: the same request mix either way (prompt sharing, parallel samples, preemption)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from lab.errors import InputError
from lab.kv_cache.pool_view import PoolSnapshot
from lab.engine import EngineConfig
from lab.engine.live import RuntimeRunConfig, run_runtime

from simulator.core.engine import SimConfig, Simulator
from simulator.core.workloads import SyntheticSpec, synthetic_workload

SOURCES = ("simulator", "engine")
Frame = tuple[int, PoolSnapshot]  # (step, the pool after it)


@dataclass(slots=True)
class PoolRunConfig:
    """What drives the pool (``source``: the paged simulator on Alpaca-like requests at 40 req/s, or the tiny
    engine on random prompts of 8-48 tokens), its size, and how often a frame is kept."""

    source: str = "simulator"
    num_blocks: int = 160
    block_size: int = 16
    num_requests: int = 24
    n: int = 1
    shared_prefix_tokens: int = 0
    preemption_mode: str = "recompute"
    frame_every: int = 2
    kv_offload_blocks: int = 0  # host slots of the prefix cache's offload tier (0: none)


def record_pool_frames(config: PoolRunConfig, on_frame: Callable[[Frame], None] | None = None) -> list[Frame]:
    """Run ``config`` and return a frame every ``frame_every`` steps, handing each to ``on_frame`` as it comes.
    Raises ``ValueError`` for an unknown source or a run too short to record one frame."""
    if config.source not in SOURCES:
        raise InputError(f"PoolRunConfig.source={config.source!r}: expected one of {', '.join(SOURCES)}")
    frames: list[Frame] = []

    def keep(frame: Frame) -> None:
        frames.append(frame)
        if on_frame is not None:
            on_frame(frame)

    (_simulate if config.source == "simulator" else _serve)(config, keep)
    if not frames:
        raise InputError("the run ended before the first frame; record frames more often")
    return frames


def busiest_frame(frames: list[Frame]) -> int:
    """The index of the frame with the most blocks in use (the first such)."""
    return max(range(len(frames)), key=lambda i: len(frames[i][1].ref_counts) - frames[i][1].num_free_blocks)


def _simulate(config: PoolRunConfig, keep: Callable[[Frame], None]) -> None:
    workload = synthetic_workload(SyntheticSpec("alpaca", num_requests=config.num_requests, rate=40.0, n=config.n,
                                                shared_prefix_tokens=config.shared_prefix_tokens))
    sim_config = SimConfig(allocator="paged", block_size=config.block_size,
                           capacity_tokens=config.num_blocks * config.block_size, max_model_len=4096,
                           preemption_mode=config.preemption_mode, kv_offload_blocks=config.kv_offload_blocks)
    Simulator(workload, sim_config, lambda snapshot: keep((snapshot.stats.step, snapshot.pool)),
              config.frame_every).run()


def _serve(config: PoolRunConfig, keep: Callable[[Frame], None]) -> None:
    engine = EngineConfig(block_size=config.block_size, num_blocks=config.num_blocks, max_num_seqs=64,
                          preemption_mode=config.preemption_mode, kv_offload_blocks=config.kv_offload_blocks)
    run = RuntimeRunConfig(num_requests=config.num_requests, prompt_len_range=(8, 48), max_tokens_range=(8, 48),
                           shared_prefix_tokens=config.shared_prefix_tokens, n=config.n,
                           temperature=1.0 if config.n > 1 else 0.0, engine=engine)
    run_runtime(run, on_step=lambda stats, pool: None if pool is None else keep((stats.step, pool)),
                frame_every=config.frame_every)
