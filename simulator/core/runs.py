"""Runs of the simulator, the calls a user makes: ``simulate`` one configuration, ``compare`` several on one workload
(side by side in worker processes, reusing finished runs), the app's default inputs and the block-size and offload
sweeps. ``simulator`` re-exports them."""
from __future__ import annotations

import contextlib
import dataclasses
import math
from collections import OrderedDict
from pathlib import Path
from typing import Callable, MutableMapping

import pandas as pd

from lab.checks import check_int, entry_point
from lab.errors import InputError
from lab.files import file_digest
from .allocators import ALLOCATORS
from .cluster import run_simulation
from .engine import FILE_FIELDS, SimConfig, SimResult, Snapshot, offload_blocks
from .presets import APP_DEFAULTS, make_configs
from .workloads import SYNTHETIC_PRESETS, SyntheticSpec, Workload, at_mean_rate, load_trace, synthetic_workload


@entry_point(forwards=SyntheticSpec, sets=("preset",))
def make_workload(workload: str | Path | Workload, num_requests: int | None = None, seed: int = 0,
                  time_scale: float = 1.0, **synthetic) -> Workload:
    """A ``Workload`` from a preset name (with ``SyntheticSpec`` fields as keywords), a trace path (its first
    ``num_requests`` rows, arrival offsets multiplied by ``time_scale`` or, given a finite ``rate``, rescaled to that
    mean rate: ``at_mean_rate``), or itself. A keyword the source would ignore is a ``ValueError``."""
    if isinstance(workload, Workload):
        given = [name for name, value, default in (("num_requests", num_requests, None), ("seed", seed, 0),
                                                    ("time_scale", time_scale, 1.0)) if value != default]
        if given or synthetic:
            raise InputError(f"{', '.join(given + sorted(synthetic))} would be ignored: the workload {workload.name!r} "
                             f"is built already (make a new one, or take its subset)")
        return workload
    if not isinstance(workload, (str, Path)):
        raise InputError(f"workload must be a preset name ({', '.join(SYNTHETIC_PRESETS)}), a trace path or a "
                         f"Workload; got {type(workload).__name__} {workload!r:.60}")
    if str(workload) in SYNTHETIC_PRESETS:
        if time_scale != 1.0:
            raise InputError(f"a time scale applies to a trace's arrivals; the {workload} preset's come from its rate")
        spec = SyntheticSpec(preset=str(workload), seed=seed, **synthetic)
        if num_requests is not None:
            spec.num_requests = num_requests
        return synthetic_workload(spec)
    if not Path(workload).exists():
        raise InputError(f"workload {str(workload)!r} is neither a preset ({', '.join(SYNTHETIC_PRESETS)}) nor an "
                         f"existing trace file")
    rate = synthetic.pop("rate", math.inf)
    if seed != 0:
        synthetic["seed"] = seed
    if synthetic:
        raise InputError(f"{', '.join(sorted(synthetic))}: for a synthetic preset; the trace {workload} brings its own "
                         f"lengths and one sample per request")
    if rate != math.inf and time_scale != 1.0:
        raise InputError(f"give the trace {workload} a rate or a time scale, not both: the rate sets its mean arrival "
                         f"rate whatever the scale")
    return at_mean_rate(load_trace(workload, time_scale=time_scale, max_rows=num_requests), rate)


@entry_point(forwards=make_workload)
def simulate(workload, config: SimConfig | None = None, on_snapshot: Callable[[Snapshot], bool | None] | None = None,
             snapshot_every: int = 50, **workload_options) -> SimResult:
    """Run one allocator over a workload. ``on_snapshot`` receives a ``Snapshot`` every ``snapshot_every``
    iterations (block pool included) and may return False to stop the run early."""
    check_int("simulate", "snapshot_every", snapshot_every, 1, 1 << 31)
    return run_simulation(make_workload(workload, **workload_options), config or SimConfig(), on_snapshot,
                          snapshot_every)


@entry_point(forwards=make_workload)
def compare(workload, configs: list[SimConfig], progress: Callable[[float], bool | None] | None = None,
            workers: int = 1, reuse: MutableMapping | None = None,
            **workload_options) -> tuple[pd.DataFrame, dict[str, SimResult]]:
    """Run several configs on the same workload: a summary table (one row per config) and the results by label.
    ``progress(fraction)`` is called as runs proceed; returning False stops the remaining work. ``workers > 1``
    runs the configs side by side in that many processes (``parallel.run_in_processes``: the same results, each
    run being deterministic; progress then moves as runs finish). ``reuse``: complete runs by (workload
    fingerprint, config), read and added to: a configuration this workload already ran with is not run again (a
    page that reruns keeps one; bounding it is the caller's)."""
    if not isinstance(configs, (list, tuple)) or not configs or not all(isinstance(c, SimConfig) for c in configs):
        raise InputError(f"configs must be a non-empty list of SimConfig (see make_configs); got {configs!r:.80}")
    check_int("compare", "workers", workers, 1, 1024)
    workload = make_workload(workload, **workload_options)
    labels = []
    for index, config in enumerate(configs):
        labels.append(config.label if config.label not in labels else f"{config.label} #{index + 1}")
    keys = [(workload.fingerprint(), config_key(config)) for config in configs] if reuse is not None else []
    kept = {}
    for index, key in enumerate(keys):
        with contextlib.suppress(KeyError):  # not kept, or gone since (another page's run may evict it)
            kept[index] = reuse[key]
    missing = [index for index in range(len(configs)) if index not in kept]
    if workers > 1 and reuse:  # the slowest first (by their last run on any workload): the workers finish together
        seconds = {config: run.summary["wall_time_s"] for (_, config), run in list(reuse.items())}
        missing.sort(key=lambda index: -seconds.get(keys[index][1], 0.0))

    def keep(position: int, run: SimResult) -> None:  # each run as it finishes: a page's Stop keeps those that did
        if reuse is not None and not run.summary["stopped_early"]:
            reuse[keys[missing[position]]] = run

    fresh = dict(zip(missing, _run_all(workload, [configs[index] for index in missing], workers, progress, keep)))
    results = {}
    for index, label in enumerate(labels):
        run = kept[index] if index in kept else fresh[index]
        if run is None:
            continue
        results[label] = run
        if reuse is not None and index in fresh and keys[index] not in reuse and not run.summary["stopped_early"]:
            reuse[keys[index]] = run  # a run the callback did not hear of
    table = pd.DataFrame([{"label": label, **r.summary} for label, r in results.items()])
    return table, results


@entry_point
def finished_configs(workload: Workload, configs: list[SimConfig], reuse: MutableMapping) -> list[SimConfig]:
    """The ``configs`` whose runs on ``workload`` are in ``reuse`` (``compare``'s): what a stopped comparison
    finished, which ``compare`` then shows at once without running anything."""
    fingerprint = workload.fingerprint()
    return [config for config in configs if (fingerprint, config_key(config)) in reuse]


def config_key(config: SimConfig) -> str:
    """A configuration's identity for reusing its runs: its ``repr``, and the content (SHA-256) of each file it reads
    (``FILE_FIELDS``: a kernel CSV, a profile JSON), so that a rewritten file is run again."""
    digests = {name: file_digest(value) for name in FILE_FIELDS
               if isinstance(value := getattr(config, name), (str, Path)) and Path(value).is_file()}
    return repr(config) + (f" files={digests}" if digests else "")


@entry_point
class RunCache(OrderedDict):
    """A ``compare(..., reuse=)`` mapping that keeps the ``max_runs`` most recently used runs."""

    def __init__(self, max_runs: int):
        check_int("RunCache", "max_runs", max_runs, 1, 1 << 20)
        super().__init__()
        self.max_runs = max_runs

    def __getitem__(self, key):
        self.move_to_end(key)
        return super().__getitem__(key)

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.max_runs:
            self.popitem(last=False)


def _run_all(workload: Workload, configs: list[SimConfig], workers: int,
             progress: Callable[[float], bool | None] | None,
             on_result: Callable[[int, SimResult], None]) -> list[SimResult | None]:
    """Each config's run (None for those a stop left unrun), in processes or one after another; ``on_result``
    hears of each as it finishes."""
    if workers > 1 and len(configs) > 1:
        from .parallel import run_in_processes

        return run_in_processes(workload, configs, workers, progress, on_result)
    runs: list[SimResult | None] = [None] * len(configs)
    for index, config in enumerate(configs):
        def on_snapshot(snapshot, index=index):
            return None if progress is None else progress((index + snapshot.progress) / len(configs))

        runs[index] = run_simulation(workload, config, on_snapshot=on_snapshot, snapshot_every=100,
                                     snapshot_pool=False)
        on_result(index, runs[index])
        if runs[index].summary["stopped_early"]:
            break
    return runs


@entry_point
def default_inputs(num_requests: int = APP_DEFAULTS["num_requests"], rate: float = APP_DEFAULTS["rate"]):
    """The page's opening workload (``APP_DEFAULTS``, at ``rate``) and configurations: every allocator, paged at
    the default block size."""
    d = APP_DEFAULTS
    workload = make_workload(d["preset"], num_requests=num_requests, rate=rate, max_model_len=d["max_model_len"])
    configs = make_configs(list(ALLOCATORS), [d["block_size"]], model=d["model"], gpu=d["gpu"],
                           max_model_len=d["max_model_len"])
    return workload, configs


@entry_point
def default_comparison(num_requests: int = APP_DEFAULTS["num_requests"]):
    """The page's opening comparison (``default_inputs``)."""
    return compare(*default_inputs(num_requests))


BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@entry_point
def block_size_sweep_workloads(workload: Workload, max_model_len: int, num_requests: int = 300) -> dict:
    """What a block-size sweep beside a comparison runs on: the workload's first ``num_requests`` requests and the
    other synthetic preset (Alpaca's short requests beside ShareGPT's long ones) at the same arrival rate."""
    spec = workload.meta.get("spec")
    other = "alpaca" if workload.name != "alpaca" else "sharegpt"
    return {workload.name: workload.subset(range(min(len(workload), num_requests))),
            other: make_workload(other, num_requests=num_requests, rate=getattr(spec, "rate", math.inf),
                                 max_model_len=max_model_len)}


@entry_point
def block_size_sweep(workloads: dict[str, Workload], config: SimConfig,
                     block_sizes: tuple[int, ...] = BLOCK_SIZES,
                     on_row: Callable[[dict, float], object] | None = None) -> pd.DataFrame:
    """The paged allocator at each block size on each workload (``config`` otherwise): internal fragmentation,
    throughput and mean running sequences, one row per (workload, block size). Small blocks waste less of their
    last block but slow the attention kernel (``CostModel.block_slowdown``); large ones the reverse.
    ``on_row(row, fraction done)`` hears of each row as it is made (a page's progress, and what a Stop keeps)."""
    rows = []
    if not workloads or not block_sizes:
        raise InputError("block_size_sweep needs at least one workload and one block size")
    too_large = [b for b in block_sizes if config.capacity_tokens is not None and b > config.capacity_tokens]
    if too_large:  # a pool must hold at least one block
        raise InputError(f"block size {too_large[0]} is larger than the pool's {config.capacity_tokens} token slots")
    for name, workload in workloads.items():
        for block_size in block_sizes:
            run = dataclasses.replace(config, allocator="paged", block_size=block_size, record_steps=False)
            summary = run_simulation(workload, run, snapshot_pool=False).summary
            rows.append({"workload": name, "block_size": block_size,
                         "internal_fragmentation_pct": 100 * summary["internal_fragmentation_frac"],
                         "throughput_tok_s": summary["throughput_tok_s"],
                         "mean_batch_size": summary["mean_batch_size"]})
            if on_row is not None:
                on_row(rows[-1], len(rows) / (len(workloads) * len(block_sizes)))
    return pd.DataFrame(rows)


OFFLOAD_TIERS_GIB = (0.0, 8.0, 32.0, 128.0, math.inf)


@entry_point
def offload_sweep(workload: Workload, config: SimConfig,
                  tiers_gib: tuple[float, ...] = OFFLOAD_TIERS_GIB,
                  on_row: Callable[[dict, float], object] | None = None) -> pd.DataFrame:
    """What a CPU tier buys: the paged allocator (``config`` otherwise, prefix caching on) with a host offload tier
    of each size: prefix-cache hit rate (GPU + tier, %), the share the tier served (%), TTFT p50/p90 and
    throughput, one row per tier size. ``on_row(row, fraction done)`` hears of each row as it is made."""
    if not config.enable_prefix_caching:
        raise InputError("offload_sweep: the offload tier keeps the prefix cache's blocks, and this configuration "
                         "has prefix caching off")
    if not tiers_gib:
        raise InputError("offload_sweep needs at least one tier size")
    base = dataclasses.replace(config, allocator="paged", record_steps=False)
    rows = []
    for gib in tiers_gib:
        summary = run_simulation(workload, dataclasses.replace(base, kv_offload_blocks=offload_blocks(base, gib)),
                                 snapshot_pool=False).summary
        rows.append({"tier_gib": gib, "tier": "unbounded" if gib == math.inf else f"{gib:g} GiB",
                     "prefix_cache_hit_pct": 100 * summary["prefix_cache_hit_rate"],
                     "offload_hit_pct": 100 * summary.get("offload_hit_rate", 0.0),
                     "ttft_p50_s": summary["ttft_p50_s"], "ttft_p90_s": summary["ttft_p90_s"],
                     "throughput_tok_s": summary["throughput_tok_s"], "preemptions": summary["preemptions"]})
        if on_row is not None:
            on_row(rows[-1], len(rows) / len(tiers_gib))
    return pd.DataFrame(rows)


PRECISION_STEPS = (("paging", "paged", "auto"), ("fp8", "contiguous", "fp8"), ("together", "paged", "fp8"))


@entry_point
def precision_gains(workload: Workload, paged: SimConfig, contiguous: SimConfig,
                    kv_cache_dtype: str = "fp8_e4m3") -> pd.DataFrame:
    """What FP8 buys next to what paging buys: ``contiguous`` and ``paged`` (each as given, its own KV cache dtype
    replaced) run with the model's dtype in the KV cache (``auto``) and with ``kv_cache_dtype``. One row per run
    (``step``: ``baseline`` = contiguous with ``auto``, ``paging`` = paged with ``auto``, ``fp8`` = contiguous with
    FP8, ``together`` = paged with FP8), its mean running sequences, throughput and KV capacity (tokens), and each
    against the baseline's (``*_x``): paging xA, FP8 xB, together xC."""
    if kv_cache_dtype == "auto":
        raise InputError("precision_gains: choose an FP8 kv_cache_dtype to compare with 'auto'")
    if paged.allocator != "paged" or contiguous.allocator == "paged":
        raise InputError(f"precision_gains takes a paged and a contiguous configuration, got {paged.label} and "
                         f"{contiguous.label}")
    rows = []
    for step, allocator, dtype in (("baseline", "contiguous", "auto"), *PRECISION_STEPS):
        base = paged if allocator == "paged" else contiguous
        config = dataclasses.replace(base, kv_cache_dtype=kv_cache_dtype if dtype == "fp8" else "auto",
                                     record_steps=False)
        summary = run_simulation(workload, config, snapshot_pool=False).summary
        rows.append({"step": step, "label": config.label, "kv_cache_dtype": config.kv_cache_dtype,
                     "mean_batch_size": summary["mean_batch_size"], "throughput_tok_s": summary["throughput_tok_s"],
                     "capacity_tokens": summary["capacity_tokens"]})
    table = pd.DataFrame(rows)
    for column in ("mean_batch_size", "throughput_tok_s", "capacity_tokens"):
        baseline = table.at[0, column]
        table[f"{column}_x"] = table[column] / baseline if baseline else float("nan")
    return table
