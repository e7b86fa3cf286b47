"""What a person reads first: the headline answer of a comparison, human labels with units, a glossary, and the
settings of a comparison."""
from __future__ import annotations

import math

import pandas as pd

from lab.results import settings_of

from .engine import SimConfig
from .workloads import Workload

# Summary columns as a person reads them (percentages are of the whole KV pool unless a label says otherwise).
LABELS = {
    "label": "Allocator", "token_states_frac": "Holding tokens (% of KV)", "reserved_frac": "Reserved (% of KV)",
    "internal_fragmentation_frac": "Internal fragmentation (% of KV)",
    "external_fragmentation_frac": "External fragmentation (% of KV)", "free_frac": "Free (% of KV)",
    "sharing_saving_frac": "Saved by sharing (% of KV)", "mean_batch_size": "Mean running sequences",
    "peak_batch_size": "Peak running sequences", "throughput_tok_s": "Throughput (output tokens/s)",
    "ttft_p50_s": "TTFT p50 (s)", "tpot_p50_s": "TPOT p50 (s)", "preemptions": "Preemptions",
    "num_requests_completed": "Requests completed", "num_requests_rejected": "Requests rejected",
    "capacity_tokens": "KV capacity (tokens)", "host_capacity_tokens": "Host KV pool (tokens; swap and offload tier)",
    "block_size": "Block size (tokens)", "paper_token_states_frac": "Paper: holding tokens (% of KV)",
    "ttft_p90_s": "TTFT p90 (s)", "tpot_p90_s": "TPOT p90 (s)", "rate": "Arrival rate (requests/s)",
    "allocator": "Allocator", "replicas": "Replicas", "model": "Model", "gpu": "GPU",
}
PERCENT_COLUMNS = tuple(column for column, label in LABELS.items() if "(%" in label)

GLOSSARY = {
    "KV cache": "The keys and values of every token a request has seen, kept on the GPU so each new token attends "
                "to them without recomputing; it grows by one token per step per request.",
    "Paged (paged-B16)": "KV in fixed blocks of B tokens anywhere in the pool, found through a block table (the "
                         "vLLM idea); a request holds at most one partly filled block.",
    "Contiguous allocators": "Each request gets one contiguous region: `contiguous-max` reserves the maximum "
                             "length, `-pow2` rounds the final length up to a power of two, `-oracle` knows the "
                             "final length, `-grow` grows by copying when full.",
    "Holding tokens": "Slots that hold a token's KV right now: the useful part.",
    "Reserved": "Slots allocated to a request for tokens it has not generated yet.",
    "Internal fragmentation": "Slots allocated to a request that it will never fill.",
    "External fragmentation": "Free slots too scattered to give a request a region (zero for paged).",
    "Waste": "Reserved + internal + external fragmentation.",
    "Running sequences": "Requests (samples) in the batch at once; more fit when less memory is wasted.",
    "TTFT": "Time to first token: from a request's arrival to its first output token.",
    "TPOT": "Time per output token after the first: the decode speed a user sees.",
    "Preemption": "A request pushed out of the batch for lack of memory: its KV is dropped and recomputed later "
                  "(recompute) or moved to host memory (swap).",
    "Block size": "Tokens per block: small blocks waste less in the last block but make the attention kernel "
                  "slower (more block-table lookups and shorter loads).",
}


def headline(summary: pd.DataFrame) -> pd.DataFrame:
    """The answer first, one row per run: how much of the *allocated* KV holds tokens, how much is wasted (in %
    of the allocated KV and in GiB), the mean and peak running sequences and the throughput."""
    allocated = 1.0 - summary["free_frac"]
    waste = summary["reserved_frac"] + summary["internal_fragmentation_frac"] + summary["external_fragmentation_frac"]
    return pd.DataFrame({
        "Allocator": summary["label"],
        "Allocated KV holding tokens (%)": 100 * summary["token_states_frac"] / allocated,
        "Waste (% of allocated KV)": 100 * waste / allocated,
        "Waste (GiB, mean)": waste * summary["kv_capacity_gib"],
        "Mean running sequences": summary["mean_batch_size"],
        "Peak running sequences": summary["peak_batch_size"],
        "Throughput (output tokens/s)": summary["throughput_tok_s"],
    })


def paged_vs_best_contiguous(summary: pd.DataFrame) -> pd.DataFrame:
    """For each headline figure: the best paged run, the best contiguous run (lowest waste, highest otherwise) and
    their ratio; empty when either kind is missing."""
    table = headline(summary)
    paged = table[summary["allocator"] == "paged"]
    contiguous = table[summary["allocator"] != "paged"]
    columns = ["Figure", "Paged", "Paged run", "Best contiguous", "Contiguous run", "Paged / contiguous"]
    if paged.empty or contiguous.empty:
        return pd.DataFrame(columns=columns)
    rows = []
    for figure in table.columns[1:]:
        lower_is_better = figure.startswith("Waste")
        pick = (lambda frame: frame.loc[frame[figure].idxmin()]) if lower_is_better else \
            (lambda frame: frame.loc[frame[figure].idxmax()])
        best_paged, best_contiguous = pick(paged), pick(contiguous)
        ratio = best_paged[figure] / best_contiguous[figure] if best_contiguous[figure] else math.inf
        rows.append(dict(zip(columns, (figure, best_paged[figure], best_paged["Allocator"], best_contiguous[figure],
                                       best_contiguous["Allocator"], ratio))))
    return pd.DataFrame(rows, columns=columns)


def readable(summary: pd.DataFrame, columns: list[str]) -> pd.DataFrame:
    """``columns`` of a summary with human labels, fractions as percentages."""
    shown = summary[[c for c in columns if c in summary]].copy()
    for column in shown.columns:
        if column in PERCENT_COLUMNS:
            shown[column] = shown[column] * 100
    return shown.rename(columns=LABELS)


def describe_workload(summary: dict) -> str:
    """``Workload.summary()`` in a sentence: how many requests, over how long, how long they are."""
    rate = summary["rate_req_s"]
    arrivals = "all at once" if rate == math.inf else f"over {summary['duration_s']:,.1f} s ({rate:,.3g} requests/s)"
    samples = f", {summary['n']} samples each" if summary["n"] > 1 else \
        f", beam search of width {summary['beam_width']}" if summary["beam_width"] > 1 else ""
    return (f"{summary['num_requests']:,} requests of the {summary['workload']} workload arriving {arrivals}; "
            f"prompts of {summary['prompt_mean']:,.0f} and outputs of {summary['output_mean']:,.0f} tokens on "
            f"average{samples}.")


def run_settings(workload: Workload, config: SimConfig) -> dict:
    """What produced a comparison (the fields its runs share; allocator and block size are per-row columns): the
    workload and its parameters, model, GPU, memory, scheduler settings, seeds and the lab's version."""
    spec = workload.meta.get("spec")
    settings = {"workload": workload.name, "workload_source": workload.source, "num_requests": len(workload),
                "arrival_rate_req_s": getattr(spec, "rate", workload.summary()["rate_req_s"]),
                "burstiness": getattr(spec, "burstiness", math.nan), "n": workload.n, "beam_width": workload.beam_width,
                "shared_prefix_tokens": workload.shared_prefix_tokens, "workload_seed": getattr(spec, "seed", math.nan)}
    for field in ("model", "gpu", "tp", "max_model_len", "capacity_tokens", "gpu_memory_utilization", "max_num_seqs",
                  "max_num_batched_tokens", "scheduling", "preemption_mode", "enable_prefix_caching", "address_space",
                  "kernel_csv", "kv_offload_blocks", "seed"):
        value = getattr(config, field)
        settings[field] = value if isinstance(value, (int, float, str, bool)) or value is None else \
            getattr(value, "name", str(value))
    settings.update({f"model_{k}": v for k, v in config.model_overrides.items()})
    settings.update({f"gpu_{k}": v for k, v in config.gpu_overrides.items()})
    return settings_of(settings)
