"""What a person reads first: the headline answer of a comparison, human labels with units, a glossary, and the
settings of a comparison."""
from __future__ import annotations

import dataclasses
import math

import pandas as pd

from lab.report.results import COLUMN_LABELS, human_columns, human_label, human_number, settings_of

from simulator.core.engine import SchedulingSettings, SimConfig
from simulator.core.workloads import Workload

# Summary columns as a person reads them (percentages are of the whole KV pool unless a label says otherwise): the
# lab's labels (lab.report.results.COLUMN_LABELS) and the simulator's own.
SUMMARY_LABELS = {
    "label": "Allocator", "token_states_frac": "Holding tokens (% of KV)", "reserved_frac": "Reserved (% of KV)",
    "internal_fragmentation_frac": "Internal fragmentation (% of KV)",
    "external_fragmentation_frac": "External fragmentation (% of KV)", "free_frac": "Free (% of KV)",
    "sharing_saving_frac": "Saved by sharing (% of KV)", "mean_batch_size": "Mean running sequences",
    "peak_batch_size": "Peak running sequences", "num_requests_completed": "Requests completed",
    "num_requests_rejected": "Requests rejected", "capacity_tokens": "KV capacity (tokens)",
    "host_capacity_tokens": "Host KV pool (tokens; swap and offload tier)",
    "paper_token_states_frac": "Paper: holding tokens (% of KV)",
    "normalized_latency_s_per_token": "Normalized latency (s per output token)", "preemption_mode": "Preemption",
    "max_rate_req_s": "Highest sustainable rate (requests/s)", "prefix_tokens": "Shared prefix (tokens)",
}
LABELS = {**COLUMN_LABELS, **SUMMARY_LABELS}
PERCENT_COLUMNS = tuple(column for column, label in SUMMARY_LABELS.items() if "(%" in label)

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
    """Every headline figure of two runs: the paged run and the contiguous run of highest throughput (the one that
    serves most; the first on a tie), so that all figures of a side come from one configuration, named in
    ``Paged run`` and ``Contiguous run``. ``Paged / contiguous`` is their ratio, NaN where the contiguous figure is
    zero (a ratio against nothing says nothing); empty when either kind is missing or served no request."""
    table = headline(summary)
    columns = ["Figure", "Paged", "Paged run", "Best contiguous", "Contiguous run", "Paged / contiguous"]
    served = summary["num_requests_completed"] > 0
    paged = table[(summary["allocator"] == "paged") & served]
    contiguous = table[(summary["allocator"] != "paged") & served]
    if paged.empty or contiguous.empty:
        return pd.DataFrame(columns=columns)
    throughput = "Throughput (output tokens/s)"
    best_paged = paged.loc[paged[throughput].idxmax()]
    best_contiguous = contiguous.loc[contiguous[throughput].idxmax()]
    rows = []
    for figure in table.columns[1:]:
        ratio = best_paged[figure] / best_contiguous[figure] if best_contiguous[figure] else math.nan
        rows.append(dict(zip(columns, (figure, best_paged[figure], best_paged["Allocator"], best_contiguous[figure],
                                       best_contiguous["Allocator"], ratio))))
    return pd.DataFrame(rows, columns=columns)


def compare_card(row: pd.Series, unit: str) -> tuple[str, str]:
    """A headline card's value and its comparison naming the contiguous run: ``("98.6 %", "1.40× contiguous-grow's
    70.2 %")``. Waste compares as a difference (a ratio against zero waste means nothing)."""
    value = f"{human_number(row['Paged'])}{unit}"
    other = f"{row['Contiguous run']}'s {human_number(row['Best contiguous'])}{unit}"
    if row["Figure"].startswith("Waste"):
        saved = row["Best contiguous"] - row["Paged"]
        comparison = f"{human_number(abs(saved))}{unit} {'less' if saved >= 0 else 'more'} than {other}"
    elif math.isnan(row["Paged / contiguous"]):
        comparison = f"against {other}"
    else:
        comparison = f"{row['Paged / contiguous']:.2f}× {other}"
    return value, comparison


def label(column: str) -> str:
    """A summary column as a person reads it: its ``LABELS`` label, else ``lab.report.results.human_label``'s words."""
    return LABELS.get(column) or human_label(column)


def readable(summary: pd.DataFrame, columns: list[str]) -> pd.DataFrame:
    """``columns`` of a summary with human labels (``LABELS``, else the name in words), fractions as percentages."""
    shown = summary[[c for c in columns if c in summary]].copy()
    for column in shown.columns:
        if column in PERCENT_COLUMNS:
            shown[column] = shown[column] * 100
    return human_columns(shown, LABELS)


def describe_workload(summary: dict) -> str:
    """``Workload.summary()`` in a sentence: how many requests, over how long, how long they are."""
    rate = summary["rate_req_s"]
    arrivals = "all at once" if rate == math.inf else f"over {summary['duration_s']:,.1f} s ({rate:,.3g} requests/s)"
    samples = f", {summary['n']} samples each" if summary["n"] > 1 else \
        f", beam search of width {summary['beam_width']}" if summary["beam_width"] > 1 else ""
    return (f"{summary['num_requests']:,} requests of the {summary['workload']} workload arriving {arrivals}; "
            f"prompts of {summary['prompt_mean']:,.0f} and outputs of {summary['output_mean']:,.0f} tokens on "
            f"average{samples}.")


def run_settings(workload: Workload, configs: SimConfig | list[SimConfig]) -> dict:
    """What produced a comparison (the fields its runs share; allocator and block size are per-row columns): the
    workload and its parameters, model, GPU, memory, scheduler settings, seeds and the lab's version, and the
    paged block sizes compared (``paged_block_sizes``, e.g. ``16+128``; they also name the export's file)."""
    configs = configs if isinstance(configs, list) else [configs]
    config = configs[0]
    spec = workload.meta.get("spec")
    settings = {"workload": workload.name, "workload_source": workload.source, "num_requests": len(workload),
                "arrival_rate_req_s": getattr(spec, "rate", workload.summary()["rate_req_s"]),
                "burstiness": getattr(spec, "burstiness", math.nan), "n": workload.n, "beam_width": workload.beam_width,
                "shared_prefix_tokens": workload.shared_prefix_tokens, "workload_seed": getattr(spec, "seed", math.nan)}
    scheduling = [f.name for f in dataclasses.fields(SchedulingSettings)]  # every scheduler setting, as it grows
    for field in ("model", "gpu", "tp", "max_model_len", "capacity_tokens", "gpu_memory_utilization", *scheduling,
                  "enable_prefix_caching", "address_space", "kernel_csv", "profile", "kv_offload_blocks",
                  "kv_cache_dtype", "seed"):
        value = getattr(config, field)
        settings[field] = value if isinstance(value, (int, float, str, bool)) or value is None else \
            getattr(value, "name", str(value))
    settings.update({f"model_{k}": v for k, v in config.model_overrides.items()})
    settings.update({f"gpu_{k}": v for k, v in config.gpu_overrides.items()})
    block_sizes = sorted({c.block_size for c in configs if c.allocator == "paged"})
    settings["paged_block_sizes"] = "+".join(map(str, block_sizes)) if block_sizes else None
    return settings_of(settings)


def precision_card(table: pd.DataFrame, column: str) -> tuple[str, str]:
    """A headline card's value and comparison of ``precision_gains``' ``column`` (``mean_batch_size`` or
    ``throughput_tok_s``), each factor against contiguous with the model's dtype in the KV cache: ``("together ×3.40",
    "paging ×1.80, FP8 ×1.95")``; read together, "paging ×A, FP8 ×B, together ×C"."""
    factors = table.set_index("step")[f"{column}_x"]
    return f"together ×{factors['together']:.2f}", f"paging ×{factors['paging']:.2f}, FP8 ×{factors['fp8']:.2f}"
