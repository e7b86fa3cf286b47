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
    "label": "Allocator", "token_states_frac": "Holding tokens (% of KV)",
    "allocated_holding_frac": "Allocated KV holding tokens (%)", "reserved_frac": "Reserved (% of KV)",
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


# ---- per request: latencies, SLOs, overload --------------------------------------------------------------------
REQUEST_COLUMNS = ("run", "request", "arrival_s", "queue_s", "ttft_s", "tpot_s", "itl_s", "e2e_s", "prompt_tokens",
                   "output_tokens", "preemptions", "rejected")
REQUEST_LABELS = {"run": "Run", "request": "Request", "arrival_s": "Arrival (s)",
                  "queue_s": "Queued before its first-token step (s)", "ttft_s": "TTFT (s)",
                  "tpot_s": "TPOT (s per output token)", "itl_s": "Mean inter-token latency (s)",
                  "e2e_s": "End-to-end latency (s)", "prompt_tokens": "Prompt tokens",
                  "output_tokens": "Output tokens", "preemptions": "Preemptions", "rejected": "Rejected"}


def request_table(runs: dict) -> pd.DataFrame:
    """Every request of every run (``runs``: label -> ``SimResult``), one row each: when it arrived, how long it
    queued (arrival to the start of the step that made its first token: with prefill-first scheduling its wait in
    the queue; chunked, that and its earlier prompt chunks), its TTFT, TPOT, mean inter-token latency and end-to-end
    latency (``lab.latency``'s definitions; NaN for a request that did not finish), its tokens, how often it was
    preempted and whether it was rejected."""
    from lab.latency import request_latencies

    frames = []
    for label, run in runs.items():
        requests = run.requests
        latencies = request_latencies(requests["arrival_s"], requests["first_token_s"], requests["finish_s"],
                                      requests["output_tokens"])
        frames.append(pd.DataFrame({
            "run": label, "request": requests.index.to_numpy(), "arrival_s": requests["arrival_s"].to_numpy(),
            "queue_s": (requests["first_token_step_s"] - requests["arrival_s"]).to_numpy(),
            **{name: latencies[name].to_numpy() for name in ("ttft_s", "tpot_s", "itl_s", "e2e_s")},
            "prompt_tokens": requests["prompt_tokens"].to_numpy(),
            "output_tokens": requests["output_tokens"].to_numpy(),
            "preemptions": requests["preemptions"].to_numpy(), "rejected": requests["rejected"].to_numpy()}))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=list(REQUEST_COLUMNS))


def goodput(requests: pd.DataFrame, ttft_slo_s: float, tpot_slo_s: float, summary: pd.DataFrame) -> pd.DataFrame:
    """Per run of ``request_table``: the share of all its requests (rejected and unfinished ones count as missing)
    that met the TTFT SLO, the TPOT SLO and both, and the goodput: requests meeting both per second of the run
    (``summary``'s ``simulated_time_s``)."""
    met_ttft = requests["ttft_s"] <= ttft_slo_s  # NaN (not finished) compares False
    met_tpot = requests["tpot_s"] <= tpot_slo_s
    table = requests.assign(met_ttft=met_ttft, met_tpot=met_tpot, met_both=met_ttft & met_tpot).groupby(
        "run", sort=False).agg(requests=("request", "size"), met_ttft_frac=("met_ttft", "mean"),
                               met_tpot_frac=("met_tpot", "mean"), met_both_frac=("met_both", "mean"),
                               met_both=("met_both", "sum")).reset_index()
    seconds = table["run"].map(summary.set_index("label")["simulated_time_s"])
    table["goodput_req_s"] = table["met_both"] / seconds.where(seconds > 0)
    return table.assign(ttft_slo_s=ttft_slo_s, tpot_slo_s=tpot_slo_s)


GOODPUT_LABELS = {"run": "Run", "requests": "Requests", "met_ttft_frac": "Met the TTFT SLO (%)",
                  "met_tpot_frac": "Met the TPOT SLO (%)", "met_both_frac": "Met both SLOs (%)",
                  "met_both": "Requests meeting both", "goodput_req_s": "Goodput (requests/s meeting both)",
                  "ttft_slo_s": "TTFT SLO (s)", "tpot_slo_s": "TPOT SLO (s per token)"}
DRAIN_LIMIT = 0.25  # a run still serving past the last arrival by this share of the arrival span is overloaded
DRAIN_MIN_S = 5.0  # ... and by at least this long (a short tail is the last requests' own decode)


def overload(requests: pd.DataFrame, summary: pd.DataFrame) -> pd.DataFrame:
    """Per run of ``request_table``: whether the arrivals outran the service (``overloaded``), with the numbers
    that say so: the offered rate (requests over the arrival span) and the served rate (finished requests over
    the same span and the drain after it), the last arrival and the run's end (``drain_s`` between them), and the
    queueing of the first and the last tenth of the requests (median ``queue_s``): a queue that grows through the
    run is one the GPU never catches up with. Empty when every request arrives at once (a batch has no rate)."""
    rows = []
    for run, frame in requests.groupby("run", sort=False):
        first, last = frame["arrival_s"].min(), frame["arrival_s"].max()
        span = last - first
        if not span > 0:
            continue
        end = float(summary.set_index("label").loc[run, "simulated_time_s"])
        tenth = max(1, len(frame) // 10)
        ordered = frame.sort_values("arrival_s")
        drain = max(0.0, end - last)
        rows.append({"run": run, "offered_req_s": (len(frame) - 1) / span,
                     "served_req_s": (~frame["e2e_s"].isna()).sum() / max(end - first, 1e-9),
                     "last_arrival_s": last, "end_s": end, "drain_s": drain,
                     "early_queue_s": ordered["queue_s"].head(tenth).median(),
                     "late_queue_s": ordered["queue_s"].tail(tenth).median(),
                     "overloaded": drain > max(DRAIN_MIN_S, DRAIN_LIMIT * span)})
    return pd.DataFrame(rows, columns=["run", "offered_req_s", "served_req_s", "last_arrival_s", "end_s", "drain_s",
                                       "early_queue_s", "late_queue_s", "overloaded"])


def overload_sentence(table: pd.DataFrame) -> str | None:
    """``overload``'s verdict in words with its numbers: the offered rate, the run that keeps up best among the
    overloaded (its served rate, its drain, its queue wait early and late) and the range of the others; None when no
    run is overloaded."""
    if table.empty:
        return None
    over = table[table["overloaded"].astype(bool)].sort_values("served_req_s", ascending=False)
    if over.empty:
        return None
    best = over.iloc[0]
    text = (f"Overloaded: requests arrive at {best.offered_req_s:,.2f} requests/s until {best.last_arrival_s:,.0f} s, "
            f"faster than {len(over)} of {len(table)} runs serve them, so their latencies measure a growing queue more "
            f"than the allocator. Even **{best.run}** serves {best.served_req_s:,.2f} requests/s and drains until "
            f"{best.end_s:,.0f} s ({best.drain_s:,.0f} s after the last arrival); its queue wait grows from "
            f"{human_number(best.early_queue_s)} s for the first tenth of requests to {human_number(best.late_queue_s)} s "
            "for the last")
    if len(over) > 1:
        rest = over.iloc[1:]
        text += (f"; the other {len(rest)} serve {rest.served_req_s.min():,.2f}–{rest.served_req_s.max():,.2f} "
                 f"requests/s and drain until {rest.end_s.min():,.0f}–{rest.end_s.max():,.0f} s")
    return text + ". Lower the arrival rate to compare them unloaded (the Load table below has every run)."


def rejection_warnings(summary: pd.DataFrame) -> list[str]:
    """One sentence per distinct rejection among the runs (``simulator.core.metrics.rejection_warning``), naming
    every run it applies to: six allocators rejecting the same requests make one warning, not six."""
    from simulator.core.metrics import rejection_warning

    rejected = summary[summary["num_requests_rejected"] > 0]
    sentences = []
    for _, group in rejected.groupby(["num_requests", "num_requests_rejected", "rejection_reasons"], sort=False):
        row = next(group.itertuples())
        sentences.append(rejection_warning(row._replace(allocator=", ".join(group["label"]))) + ".")
    return sentences


def with_allocated_share(summary: pd.DataFrame) -> pd.DataFrame:
    """``summary`` with ``allocated_holding_frac``: the share of the *allocated* KV that holds tokens (the
    headline cards' and table's figure), beside ``token_states_frac``, the share of the whole pool."""
    return summary.assign(allocated_holding_frac=summary["token_states_frac"] / (1.0 - summary["free_frac"]))


FULL_POOL = 0.95  # a run whose KV pool was at least this allocated at its peak was bound by memory


def memory_bound_sentence(table: pd.DataFrame) -> str | None:
    """Whether a sweep's runs were bound by KV memory, in words with the numbers: a run is when its pool filled
    (peak allocation at least ``FULL_POOL``) or it preempted. Only then can paging's lower waste buy anything
    (more sequences at once); a sweep where no run is says so, and what to change. None without the columns."""
    if not {"peak_allocated_frac", "preemptions", "allocator", "throughput_tok_s"} <= set(table.columns):
        return None
    done = table[table["throughput_tok_s"].notna()]
    if done.empty:
        return None
    bound = (done["peak_allocated_frac"] >= FULL_POOL) | (done["preemptions"] > 0)
    if not bound.any():
        return (f"**Not memory-bound**: in no run did the KV pool fill (peak allocation at most "
                f"{done['peak_allocated_frac'].max():.0%}, no preemptions), so every allocator fits its whole batch "
                "and paging has nothing to save; differences between allocators here are the cost model's per-block "
                "overheads, not memory. Choose a larger model, a smaller GPU or a higher arrival rate to see paging's "
                "effect.")
    runs = done[bound]
    paged = runs[runs["allocator"] == "paged"]["throughput_tok_s"]
    contiguous = runs[runs["allocator"] != "paged"]["throughput_tok_s"]
    text = (f"**Memory-bound in {int(bound.sum())} of {len(done)} runs** (the KV pool filled, or requests were "
            "preempted): there the allocator decides how many sequences run at once.")
    if len(paged) and len(contiguous):
        ratio = paged.median() / contiguous.median()
        text += (f" In those runs paged serves a median {paged.median():,.0f} output tokens/s against "
                 f"{contiguous.median():,.0f} for the contiguous allocators ({ratio:.2f}×).")
    if not bound.all():
        text += f" The other {int((~bound).sum())} runs never filled the pool: paging has nothing to save in them."
    return text
