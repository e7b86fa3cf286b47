"""Ready-made experiments."""
from __future__ import annotations

from lab.checks import entry_point
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


@entry_point
def figure2_experiment(num_requests: int = 1000, seed: int = 0) -> tuple[SyntheticSpec, list[SimConfig]]:
    """The vLLM paper's Figure 2 setup: OPT-13B on one A100-40GB, ShareGPT-like lengths, max length 2048, all
    requests at t=0 (saturating load); contiguous baselines on a buddy allocator, paged with blocks of 16."""
    spec = SyntheticSpec(preset="sharegpt", num_requests=num_requests, seed=seed, max_model_len=2048)
    common = dict(model="opt-13b", gpu="a100-40gb", max_model_len=2048, address_space="buddy")
    configs = [SimConfig(allocator=kind, **common) for kind in ("contiguous-max", "contiguous-pow2",
                                                                 "contiguous-oracle")]
    configs.append(SimConfig(allocator="paged", block_size=16, **common))
    return spec, configs


# Settings of one kind of allocator: (default, the kind that uses them, what they are). Given to a comparison that
# has no allocator of that kind they are refused; the configurations of the other kind keep the default, so that no
# output records a setting that did not apply (a contiguous run "with" an offload tier).
ALLOCATOR_SETTINGS = {
    "preemption_mode": ("recompute", "paged", "swap preemption moves a paged sequence's blocks to host memory; the "
                                              "contiguous baselines always recompute"),
    "num_cpu_blocks": (0, "paged", "the host pool of swapped paged blocks"),
    "kv_offload_gib": (0.0, "paged", "the offload tier keeps the paged prefix cache's blocks"),
    "address_space": ("first-fit", "contiguous", "how contiguous regions are placed; paged blocks have no address "
                                                 "space to place"),
    "enable_prefix_caching": (True, "paged", "the prefix cache shares paged blocks; contiguous regions share nothing"),
    "block_size": (16, "paged", "tokens per paged block; a contiguous region holds a sequence whole"),
}


@entry_point(forwards=SimConfig, sets=("allocator", "block_size"))
def make_configs(allocators: list[str], block_sizes: list[int], preemption_mode: str = "recompute",
                 kv_offload_gib: float = 0.0, **common) -> list[SimConfig]:
    """One config per contiguous allocator and one per (paged, block size); ``common`` holds the other fields.
    A setting of one kind of allocator (``ALLOCATOR_SETTINGS``: ``preemption_mode``, ``num_cpu_blocks``,
    ``kv_offload_gib`` for paged, ``address_space`` for contiguous) applies to that kind's configs only, and is
    refused when no allocator of that kind is chosen. ``kv_offload_gib``: the prefix cache's host tier (GiB, inf:
    unbounded), which needs prefix caching."""
    from .allocators import ALLOCATORS
    from .engine import check_config, offload_blocks

    if not isinstance(allocators, (list, tuple)) or not all(isinstance(a, str) for a in allocators):
        raise InputError(f"allocators must be a list of names ({', '.join(ALLOCATORS)}); got {allocators!r:.80}")
    if not isinstance(block_sizes, (list, tuple)) or not all(isinstance(b, int) and not isinstance(b, bool)
                                                             for b in block_sizes):
        raise InputError(f"block sizes must be a list of integers >= 1; got {block_sizes!r:.80}")
    unknown = [a for a in allocators if a not in ALLOCATORS]
    if unknown:
        raise InputError(f"unknown allocator(s) {', '.join(unknown)}; choose from {', '.join(ALLOCATORS)}")
    if not allocators:
        raise InputError("choose at least one allocator")
    if not block_sizes or min(block_sizes) < 1:
        raise InputError(f"block sizes must be >= 1, got {block_sizes}")
    for name, values in (("allocator", allocators), ("block size", block_sizes)):
        repeated = [value for index, value in enumerate(values) if value in values[:index]]
        if repeated:
            raise InputError(f"{name} {repeated[0]!r} is given twice: it would run twice, as two identical rows")
    given = {"preemption_mode": preemption_mode, "kv_offload_gib": kv_offload_gib,
             **{name: common.pop(name) for name in ("num_cpu_blocks", "address_space", "enable_prefix_caching")
                if name in common}}
    if list(block_sizes) != [ALLOCATOR_SETTINGS["block_size"][0]]:
        given["block_size"] = block_sizes
    kinds = {"paged" if a == "paged" else "contiguous" for a in allocators}
    for name, value in given.items():
        default, kind, what = ALLOCATOR_SETTINGS[name]
        if value not in (default, [default]) and kind not in kinds:
            raise InputError(f"{name} = {value!r} would be ignored: it applies to {kind} allocators only ({what}), "
                             f"and none is chosen ({', '.join(allocators)})")
    if kv_offload_gib and not given.get("enable_prefix_caching", True):
        raise InputError(f"kv_offload_gib = {kv_offload_gib!r} would be ignored: the offload tier keeps prefix-cache "
                         f"blocks, and prefix caching is off")
    configs = []
    for allocator in allocators:
        kind = "paged" if allocator == "paged" else "contiguous"
        own = {name: value if ALLOCATOR_SETTINGS[name][1] == kind else ALLOCATOR_SETTINGS[name][0]
               for name, value in given.items() if name not in ("kv_offload_gib", "block_size")}
        for size in block_sizes if kind == "paged" else [ALLOCATOR_SETTINGS["block_size"][0]]:
            config = SimConfig(allocator=allocator, block_size=size, **own, **common)
            if kind == "paged" and kv_offload_gib:
                config.kv_offload_blocks = offload_blocks(config, kv_offload_gib)
            check_config(config)  # before any run (a setting the others make moot included)
            configs.append(config)
    return configs
