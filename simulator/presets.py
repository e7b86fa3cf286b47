"""Ready-made experiments."""
from __future__ import annotations

from .engine import SimConfig
from .workloads import SyntheticSpec

# Token-state share of KV memory reported by the vLLM paper (Kwon et al., SOSP'23, Figure 2 and its text):
# existing systems use 20.4 % (Orca-Max) to 38.2 % (Orca-Oracle) of KV memory for token states, vLLM 96.3 %.
PAPER_FIGURE2_TOKEN_STATES = {"contiguous-max": 0.204, "contiguous-oracle": 0.382, "paged": 0.963}


def figure2_experiment(num_requests: int = 1000, seed: int = 0) -> tuple[SyntheticSpec, list[SimConfig]]:
    """The vLLM paper's Figure 2 setup: OPT-13B on one A100-40GB, ShareGPT-like lengths, max length 2048, all
    requests at t=0 (saturating load); contiguous baselines on a buddy allocator, paged with blocks of 16."""
    spec = SyntheticSpec(preset="sharegpt", num_requests=num_requests, seed=seed, max_model_len=2048)
    common = dict(model="opt-13b", gpu="a100-40gb", max_model_len=2048, address_space="buddy")
    configs = [SimConfig(allocator=kind, **common) for kind in ("contiguous-max", "contiguous-pow2",
                                                                 "contiguous-oracle")]
    configs.append(SimConfig(allocator="paged", block_size=16, **common))
    return spec, configs
