"""Ready-made experiments."""
from __future__ import annotations

from lab.errors import InputError
from .engine import SimConfig
from .workloads import SyntheticSpec

# Token-state share of KV memory reported by the vLLM paper (Kwon et al., SOSP'23, Figure 2 and its text):
# existing systems use 20.4 % (Orca-Max) to 38.2 % (Orca-Oracle) of KV memory for token states, vLLM 96.3 %.
PAPER_FIGURE2_TOKEN_STATES = {"contiguous-max": 0.204, "contiguous-oracle": 0.382, "paged": 0.963}

# The paper's Table 1 setups and the KV slots it reports for them. vLLM keeps 90 % of GPU memory and what its
# profiling run leaves after the weights; at the paper's batch sizes the activations take ~0.1 GB per GPU.
PAPER_SETUPS = {
    "opt-13b": dict(model="opt-13b", gpu="a100-40gb", tp=1),
    "opt-66b": dict(model="opt-66b", gpu="a100-40gb", tp=4),
    "opt-175b": dict(model="opt-175b", gpu="a100-80gb", tp=8),
}
PAPER_TABLE1_KV_SLOTS = {"opt-13b": 15_700, "opt-66b": 9_700, "opt-175b": 60_100}
PAPER_MEMORY = dict(gpu_memory_utilization=0.9, activation_reserve_bytes=0.1e9, max_model_len=2048)


# The Memory simulator page's opening setup: memory binds (OPT-13B's 26 GB of weights leave about 12,000 tokens of
# KV on an A100-40GB) and requests arrive fast enough to fill the pool, so the allocators differ.
APP_DEFAULTS = dict(preset="sharegpt", num_requests=1000, rate=5.0, model="opt-13b", gpu="a100-40gb", max_model_len=2048,
                    block_size=16)


def paper_config(setup: str, **fields) -> SimConfig:
    """A ``SimConfig`` on one of the paper's Table 1 setups (``PAPER_SETUPS``)."""
    if setup not in PAPER_SETUPS:
        raise InputError(f"paper setup must be one of {', '.join(PAPER_SETUPS)}; got {setup!r}")
    return SimConfig(**{**PAPER_SETUPS[setup], **PAPER_MEMORY, **fields})


def figure2_experiment(num_requests: int = 1000, seed: int = 0) -> tuple[SyntheticSpec, list[SimConfig]]:
    """The vLLM paper's Figure 2 setup: OPT-13B on one A100-40GB, ShareGPT-like lengths, max length 2048, all
    requests at t=0 (saturating load); contiguous baselines on a buddy allocator, paged with blocks of 16."""
    spec = SyntheticSpec(preset="sharegpt", num_requests=num_requests, seed=seed, max_model_len=2048)
    common = dict(model="opt-13b", gpu="a100-40gb", max_model_len=2048, address_space="buddy")
    configs = [SimConfig(allocator=kind, **common) for kind in ("contiguous-max", "contiguous-pow2",
                                                                 "contiguous-oracle")]
    configs.append(SimConfig(allocator="paged", block_size=16, **common))
    return spec, configs


def make_configs(allocators: list[str], block_sizes: list[int], preemption_mode: str = "recompute",
                 **common) -> list[SimConfig]:
    """One config per contiguous allocator and one per (paged, block size); ``common`` holds the other fields.
    ``preemption_mode`` applies to the paged configs (the contiguous baselines always recompute)."""
    from .allocators import ALLOCATORS

    unknown = [a for a in allocators if a not in ALLOCATORS]
    if unknown:
        raise InputError(f"unknown allocator(s) {', '.join(unknown)}; choose from {', '.join(ALLOCATORS)}")
    if not allocators:
        raise InputError("choose at least one allocator")
    if not block_sizes or min(block_sizes) < 1:
        raise InputError(f"block sizes must be >= 1, got {block_sizes}")
    configs = []
    for allocator in allocators:
        sizes = block_sizes if allocator == "paged" else [block_sizes[0]]
        mode = preemption_mode if allocator == "paged" else "recompute"
        configs += [SimConfig(allocator=allocator, block_size=size, preemption_mode=mode, **common)
                    for size in sizes]
    return configs
