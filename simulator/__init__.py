"""Discrete-event KV memory simulator: contiguous allocators vs the paged block manager on synthetic or real traffic.

    from simulator import simulate, SimConfig
    result = simulate("sharegpt", SimConfig(allocator="paged", block_size=16), num_requests=1000)
    result.summary, result.timeseries

The package is the simulator's public surface; its rooms (docs/architecture.md draws their arrows):

- ``core/``: the simulator proper: the engine's scheduler with a clock (``engine``), allocators, the cost model
  (``models``), metrics, workloads and traces, clusters, worker processes, closed-form checks, presets, ``runs``.
- ``twins/``: the simulator beside a real engine: the digital twin of ours, the twin of a vLLM server, live.
- ``experiments/``: many simulations: the vLLM paper's figures, sweeps and capacity plans on Ray.
- ``views/``: what a person reads: charts, labels and the headline answer, block-pool frames.
- ``cli/``: ``python -m simulator`` and its subcommands; ``bench.py``: ``python -m simulator.bench``.
"""
from .core.allocators import ALLOCATORS
from .core.checks import closed_form_checks
from .core.cluster import run_simulation
from .core.engine import SimConfig, SimResult, Simulator, Snapshot
from .core.metrics import CATEGORIES
from .core.models import GPUS, MODELS, CostModel, get_gpu, get_model, kv_capacity_tokens
from .core.presets import APP_DEFAULTS, PAPER_FIGURE2_TOKEN_STATES, figure2_experiment, make_configs
from .core.runs import (BLOCK_SIZES, OFFLOAD_TIERS_GIB, RunCache, block_size_sweep, block_size_sweep_workloads, compare,
                        default_comparison, default_inputs, finished_configs, make_workload, offload_sweep,
                        precision_gains, simulate)
from .core.workloads import (SYNTHETIC_PRESETS, SyntheticSpec, TraceFormatError, Workload, at_mean_rate, load_trace,
                             load_trace_bytes, synthetic_workload)

__all__ = ["simulate", "compare", "run_simulation", "closed_form_checks", "make_workload", "Simulator", "SimConfig", "SimResult",
           "Snapshot", "Workload", "SyntheticSpec", "TraceFormatError", "ALLOCATORS", "CATEGORIES", "MODELS", "GPUS",
           "SYNTHETIC_PRESETS", "load_trace", "load_trace_bytes", "synthetic_workload", "at_mean_rate", "make_configs",
           "figure2_experiment", "PAPER_FIGURE2_TOKEN_STATES", "CostModel", "get_model", "get_gpu",
           "kv_capacity_tokens", "RunCache", "block_size_sweep", "block_size_sweep_workloads", "BLOCK_SIZES",
           "OFFLOAD_TIERS_GIB", "offload_sweep", "precision_gains", "APP_DEFAULTS", "default_inputs",
           "default_comparison", "finished_configs"]
