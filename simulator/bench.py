"""``python -m simulator.bench``: simulator speed (median of repeats) and memory bounds; prints a table, writes CSV.
``--sweep``: a 200-run sweep serially and on a local Ray (``benchmarks/results/sweep.csv``). ``--compare``: the
Memory simulator's default comparison with and without the quiet-step fast path (``benchmarks/results/compare.csv``).

Rows: the Azure 2023 conversation trace (19,366 requests) replayed with paged B=16 and, as the in-run baseline,
contiguous-oracle; the Mooncake conversation trace's first 2,000 requests (long prompts that share prefixes) with
prefix caching on and, as the baseline, off; a 100k-request synthetic run (peak traced Python memory, timeseries
rows kept); loading a 10^6-row generic CSV trace and a 10^6-row Mooncake JSONL.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pandas as pd

from lab.cli.args import cli_settings, positive_int
from lab.report.results import print_and_save

from simulator.core.cluster import run_simulation
from simulator.core.engine import SimConfig, Simulator
from simulator.core.workloads import SyntheticSpec, at_mean_rate, load_trace, synthetic_workload

TRACES = Path(__file__).resolve().parent.parent.parent / "shared" / "traces"
AZURE_CONV = TRACES / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv"
MOONCAKE_CONV = TRACES / "mooncake_fast25" / "conversation_trace.jsonl"
OFFLOAD_LIGHT_RATE = 0.25  # req/s: the conversation trace spread out until nothing is preempted (bench_offload)


def _replay_time(workload, config: SimConfig) -> tuple[float, dict]:
    start = time.perf_counter()
    summary = Simulator(workload, config).run().summary
    return time.perf_counter() - start, summary


def _replay_rate(workload, config: SimConfig, repeats: int) -> tuple[float, dict]:
    times, summary = [], {}
    for _ in range(repeats):
        seconds, summary = _replay_time(workload, config)
        times.append(seconds)
    return len(workload) / statistics.median(times), summary


def _alternating(workload, subject: SimConfig, baseline: SimConfig, repeats: int) -> tuple[list, list, list, dict]:
    """Replay ``subject`` and ``baseline`` ``repeats`` times each, in pairs that alternate which goes first: this
    machine's speed drifts over seconds, and back-to-back runs of one config would land in one spell. Returns both
    configs' times, each pair's speed ratio (baseline time / subject time; the median is the figure to quote) and
    the last summary of each (keys ``subject``, ``baseline``)."""
    times, ratios, summaries = {"subject": [], "baseline": []}, [], {}
    configs = {"subject": subject, "baseline": baseline}
    for repeat in range(repeats):
        for name in ("subject", "baseline") if repeat % 2 == 0 else ("baseline", "subject"):
            seconds, summaries[name] = _replay_time(workload, configs[name])
            times[name].append(seconds)
        ratios.append(times["baseline"][-1] / times["subject"][-1])
    return times["subject"], times["baseline"], ratios, summaries


def _replay_row(case: str, workload, times: list[float], summary: dict) -> dict:
    return {"case": case, "value": len(workload) / statistics.median(times), "unit": "requests/s (median)",
            "iterations": summary["iterations"], "completed": summary["num_requests_completed"]}


def bench_trace(path: Path, repeats: int) -> list[dict]:
    """Paged B=16 vs contiguous-oracle replay speed, in alternating pairs (``_alternating``)."""
    workload = load_trace(path)
    paged, oracle = (SimConfig(allocator=allocator, block_size=16, model="qwen3-8b", gpu="a100-80gb",
                               max_model_len=16384) for allocator in ("paged", "contiguous-oracle"))
    paged_s, oracle_s, ratios, summaries = _alternating(workload, paged, oracle, repeats)
    return [_replay_row("azure-conv replay, paged", workload, paged_s, summaries["subject"]),
            _replay_row("azure-conv replay, contiguous-oracle", workload, oracle_s, summaries["baseline"]),
            {"case": "paged / contiguous-oracle speed", "value": statistics.median(ratios),
             "unit": f"ratio (median of {repeats} alternating pairs)"}]


def bench_prefix_caching(path: Path, num_requests: int, repeats: int) -> list[dict]:
    """Paged B=16 replay speed with prefix caching (every full prompt block hashed, looked up and registered) and
    without, on a trace whose prompts share prefixes, in alternating pairs (``_alternating``)."""
    workload = load_trace(path, max_rows=num_requests)
    cached, uncached = (SimConfig(allocator="paged", block_size=16, model="qwen3-8b", gpu="h200",
                                  max_model_len=131072, enable_prefix_caching=caching) for caching in (True, False))
    cached_s, uncached_s, ratios, summaries = _alternating(workload, cached, uncached, repeats)
    case = f"mooncake-conv {num_requests} requests, paged, prefix caching"
    return [_replay_row(f"{case} on", workload, cached_s, summaries["subject"]),
            _replay_row(f"{case} off", workload, uncached_s, summaries["baseline"]),
            {"case": "mooncake-conv prompt tokens replayed (caching on)",
             "value": float(workload.prompt_tokens.sum()) / statistics.median(cached_s), "unit": "tokens/s"},
            {"case": "mooncake-conv prefix-cache hit rate", "value": summaries["subject"]["prefix_cache_hit_rate"],
             "unit": "fraction of looked-up blocks"},
            {"case": "prefix caching on / off speed", "value": statistics.median(ratios),
             "unit": f"ratio (median of {repeats} alternating pairs)"}]


def bench_large_synthetic(num_requests: int) -> list[dict]:
    workload = synthetic_workload(SyntheticSpec(preset="sharegpt", num_requests=num_requests, rate=40.0))
    untraced = _replay_rate(workload, SimConfig(allocator="paged", block_size=16, max_points=2000), 1)[0]
    tracemalloc.start()
    start = time.perf_counter()
    result = Simulator(workload, SimConfig(allocator="paged", block_size=16, max_points=2000)).run()
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return [{"case": f"{num_requests} sharegpt requests, paged", "value": untraced, "unit": "requests/s",
             "iterations": result.summary["iterations"], "completed": result.summary["num_requests_completed"]},
            {"case": f"{num_requests} sharegpt requests, paged, traced", "value": num_requests / seconds,
             "unit": "requests/s (tracemalloc on)"},
            {"case": f"{num_requests} requests: peak traced memory", "value": peak / 2**20, "unit": "MiB"},
            {"case": f"{num_requests} requests: timeseries rows", "value": len(result.timeseries), "unit": "rows"}]


def bench_offload(path: Path, num_requests: int) -> list[dict]:
    """The prefix cache's host offload tier on a multi-turn trace: hit rate and TTFT for tiers of 0, 32 and 128 GiB
    and unbounded (Qwen3-8B on an H200, paged B=16), and the replay speed with the largest bounded tier against
    none (one run each, in the same invocation)."""
    from simulator.core.checks import unbounded_cache_hit_blocks
    from simulator.core.runs import offload_blocks

    workload = load_trace(path, max_rows=num_requests)
    base = SimConfig(allocator="paged", block_size=16, model="qwen3-8b", gpu="h200", max_model_len=131072)
    rows, seconds = [], {}
    for gib in (0.0, 32.0, 128.0, float("inf")):
        config = dataclasses.replace(base, kv_offload_blocks=offload_blocks(base, gib) if gib else 0)
        seconds[gib], summary = _replay_time(workload, config)
        case = f"mooncake-conv {num_requests} requests, offload tier {gib:g} GiB"
        rows += [{"case": f"{case}: prefix-cache hit rate (GPU + tier)", "value": summary["prefix_cache_hit_rate"],
                  "unit": "fraction of prompt blocks", "hit_blocks": summary["prefix_cache_hit_blocks"],
                  "preemptions": summary["preemptions"]},
                 {"case": f"{case}: TTFT p50", "value": summary["ttft_p50_s"], "unit": "s"},
                 {"case": f"{case}: TTFT p90", "value": summary["ttft_p90_s"], "unit": "s"}]
    bound = unbounded_cache_hit_blocks(workload, 16)
    rows.append({"case": f"mooncake-conv {num_requests} requests: never-evict bound on hit blocks",
                 "value": bound, "unit": "blocks"})
    # Saturated, recomputed sequences hit their own blocks again and the unbounded tier passes the bound; with the
    # arrivals spread out nothing is preempted and it must equal it.
    light = at_mean_rate(workload, OFFLOAD_LIGHT_RATE)
    summary = run_simulation(light, dataclasses.replace(base, kv_offload_blocks=None), snapshot_pool=False).summary
    rows.append({"case": f"mooncake-conv {num_requests} requests at {OFFLOAD_LIGHT_RATE:g} req/s, unbounded tier: "
                         f"hit blocks", "value": summary["prefix_cache_hit_blocks"], "unit": "blocks",
                 "bound": bound, "preemptions": summary["preemptions"]})
    rows.append({"case": "offload tier 128 GiB / none simulator speed", "value": seconds[0.0] / seconds[128.0],
                 "unit": "x"})
    return rows


def bench_trace_loads(num_rows: int) -> list[dict]:
    rng = np.random.default_rng(0)
    frame = pd.DataFrame({"arrival_time_s": np.cumsum(rng.exponential(0.01, num_rows)),
                          "prompt_tokens": rng.integers(1, 4096, num_rows),
                          "output_tokens": rng.integers(1, 1024, num_rows)})
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "big.csv"
        frame.to_csv(path, index=False)
        start = time.perf_counter()
        load_trace(path)
        seconds = time.perf_counter() - start
    rows = [{"case": f"load {num_rows}-row generic CSV", "value": seconds, "unit": "s"}]
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "big.jsonl"
        lengths = frame["prompt_tokens"].to_numpy()
        with open(path, "w") as handle:
            for index, (arrival, prompt, output) in enumerate(frame.itertuples(index=False)):
                ids = ",".join(str(index * 8 + j) for j in range(-(-int(lengths[index]) // 512)))
                handle.write(f'{{"timestamp": {int(arrival * 1000)}, "input_length": {prompt}, '
                             f'"output_length": {output}, "hash_ids": [{ids}]}}\n')
        start = time.perf_counter()
        load_trace(path)
        rows.append({"case": f"load {num_rows}-row Mooncake JSONL", "value": time.perf_counter() - start,
                     "unit": "s"})
    return rows


# 200 distinct runs (a contiguous allocator's block sizes would share runs: ``simulator.experiments.sweep.spec_key``)
SWEEP_GRID = {"allocator": ["paged"], "block_size": [8, 16, 32, 64, 128], "rate": [5.0, 10.0, 20.0, 40.0],
              "seed": list(range(10)), "num_requests": [1500]}


def bench_sweep(num_cpus: int) -> list[dict]:
    """The 200-run ``SWEEP_GRID`` serially (in this process) and on a local Ray of ``num_cpus`` CPUs, each into a
    fresh store; Ray's start-up is timed apart from the sweep."""
    from simulator.experiments.sweep import expand, run_sweep, start_ray

    runs = len(expand(SWEEP_GRID))
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        run_sweep(SWEEP_GRID, Path(folder) / "serial.sqlite", parallel=False, progress=False)
        serial = time.perf_counter() - start
        ray_init = start_ray(num_cpus=num_cpus)
        start = time.perf_counter()
        result = run_sweep(SWEEP_GRID, Path(folder) / "ray.sqlite", parallel=True, progress=False)
        parallel = time.perf_counter() - start
    failed = int((result.table["error"] != "").sum())
    return [{"case": f"sweep of {runs} runs, serial", "value": runs / serial, "unit": "runs/s", "seconds": serial},
            {"case": f"sweep of {runs} runs, Ray on {num_cpus} CPUs", "value": runs / parallel, "unit": "runs/s",
             "seconds": parallel, "failed": failed},
            {"case": "Ray / serial sweep speed", "value": serial / parallel, "unit": "ratio"},
            {"case": "Ray start-up (local)", "value": ray_init, "unit": "s"}]


def bench_compare(repeats: int) -> list[dict]:
    """The Memory simulator's opening comparison (``simulator.default_comparison``: every allocator at the app's
    defaults) timed as ``compare`` runs it, with the quiet-step fast path (``engine.FAST_FORWARD``) and without it
    (every step planned, as before it), alternating in one run, serially, and the page's block-size sweep alike;
    then the comparison as the page runs an arrival-rate change: a new workload each time, two worker processes,
    the runs kept (the slowest configurations first). Checks the two serial paths give the same summaries."""
    from simulator.core import engine
    from simulator.core.runs import BLOCK_SIZES, RunCache, block_size_sweep, block_size_sweep_workloads, compare, default_inputs
    from simulator.core.presets import APP_DEFAULTS as d

    workload, configs = default_inputs()
    sweep_workloads = block_size_sweep_workloads(workload, d["max_model_len"], 300)
    sweep_config = configs[-1]
    times, tables, sweeps = {True: [], False: []}, {}, {True: [], False: []}
    try:
        for repeat in range(repeats):
            for fast in (True, False) if repeat % 2 == 0 else (False, True):
                engine.FAST_FORWARD = fast
                start = time.perf_counter()
                tables[fast] = compare(workload, configs)[0].drop(columns="wall_time_s")
                times[fast].append(time.perf_counter() - start)
                start = time.perf_counter()
                block_size_sweep(sweep_workloads, sweep_config)
                sweeps[fast].append(time.perf_counter() - start)
    finally:
        engine.FAST_FORWARD = True
    if not tables[True].equals(tables[False]):
        raise AssertionError("the quiet-step fast path changed the default comparison's summaries")
    kept = RunCache(48)  # the page's: the configurations' last runs order the next ones, slowest first
    compare(workload, configs, workers=2, reuse=kept)  # the pool's start-up is not the comparison's
    parallel = []
    for repeat in range(repeats):  # as the page runs an arrival-rate change: a workload not run yet, each time
        changed, _ = default_inputs(rate=d["rate"] + 0.01 * (repeat + 1))
        start = time.perf_counter()
        compare(changed, configs, workers=2, reuse=kept)
        parallel.append(time.perf_counter() - start)
    rows = [{"case": f"default comparison ({len(configs)} configs), {name}", "value": statistics.median(values),
             "unit": "s", "min": min(values), "max": max(values)}
            for name, values in (("serial, every step planned (before)", times[False]),
                                 ("serial, quiet steps at once", times[True]),
                                 ("2 worker processes, a new arrival rate each time (the page's)", parallel))]
    rows += [{"case": f"block-size sweep ({len(BLOCK_SIZES)} sizes x 2 workloads of 300), {name}",
              "value": statistics.median(values), "unit": "s", "min": min(values), "max": max(values)}
             for name, values in (("every step planned (before)", sweeps[False]),
                                  ("quiet steps at once", sweeps[True]))]
    ratios = [before / after for before, after in zip(times[False], times[True])]
    rows.append({"case": "default comparison: speed-up of the quiet steps (pairs)", "value": statistics.median(ratios),
                 "unit": "ratio", "min": min(ratios), "max": max(ratios)})
    return rows


def bench_precision(kv_cache_dtype: str = "fp8_e4m3") -> pd.DataFrame:
    """What an FP8 KV cache buys at the Memory simulator's defaults beside what paging buys, as its cards compute it
    (``simulator.precision_gains`` on the paged run of highest throughput and the best contiguous one)."""
    from simulator.core.runs import compare, default_inputs, precision_gains
    from simulator.views.report import paged_vs_best_contiguous

    workload, configs = default_inputs()
    versus = paged_vs_best_contiguous(compare(workload, configs)[0])
    by_label = {config.label: config for config in configs}
    first = versus.iloc[0]
    return precision_gains(workload, by_label[first["Paged run"]], by_label[first["Contiguous run"]], kv_cache_dtype)


def bench_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m simulator.bench", description=__doc__)
    parser.add_argument("--trace", default=str(AZURE_CONV), help="trace of the paged vs contiguous-oracle replay")
    parser.add_argument("--repeats", type=positive_int, default=9, help="alternating paged/oracle pairs (median)")
    parser.add_argument("--mooncake-trace", default=str(MOONCAKE_CONV),
                        help="Mooncake JSONL trace of the prefix-caching replay")
    parser.add_argument("--mooncake-requests", type=positive_int, default=2000,
                        help="its first rows replayed")
    parser.add_argument("--large", type=positive_int, default=100_000, help="requests of the synthetic run")
    parser.add_argument("--csv-rows", type=positive_int, default=1_000_000, help="rows of the trace-load test")
    parser.add_argument("--out", default="benchmarks/results/simulator.csv", help="results CSV")
    parser.add_argument("--sweep", action="store_true", help="only the sweep benchmark (serial vs Ray)")
    parser.add_argument("--num-cpus", type=positive_int, default=2, help="CPUs of the local Ray (--sweep)")
    parser.add_argument("--compare", action="store_true",
                        help="only the Memory simulator's default comparison, with and without the quiet-step fast "
                             "path (benchmarks/results/compare.csv)")
    parser.add_argument("--precision", action="store_true",
                        help="only what an FP8 KV cache buys at the Memory simulator's defaults beside paging "
                             "(running sequences, throughput, capacity; benchmarks/results/kv_precision_gains.csv)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser()
    args = parser.parse_args(argv)
    if args.sweep + args.compare + args.precision > 1:
        parser.error("--sweep, --compare and --precision each run one benchmark alone: give one of them")
    if args.sweep:
        out = args.out if args.out != parser.get_default("out") else "benchmarks/results/sweep.csv"
        print_and_save(pd.DataFrame(bench_sweep(args.num_cpus)), out, settings=cli_settings(args), kind="sweep-bench")
        return 0
    if args.compare:
        out = args.out if args.out != parser.get_default("out") else "benchmarks/results/compare.csv"
        print_and_save(pd.DataFrame(bench_compare(args.repeats)), out, settings=cli_settings(args),
                       kind="compare-bench")
        return 0
    if args.precision:
        out = args.out if args.out != parser.get_default("out") else "benchmarks/results/kv_precision_gains.csv"
        print_and_save(bench_precision(), out, settings=cli_settings(args), kind="kv-precision-gains")
        return 0
    rows = []
    if Path(args.trace).is_file():
        rows += bench_trace(Path(args.trace), args.repeats)
    else:
        print(f"skipping the trace replay: {args.trace} not found")
    if Path(args.mooncake_trace).is_file():
        rows += bench_prefix_caching(Path(args.mooncake_trace), args.mooncake_requests, 3)
        rows += bench_offload(Path(args.mooncake_trace), args.mooncake_requests)
    else:
        print(f"skipping the prefix-caching replay: {args.mooncake_trace} not found")
    rows += bench_large_synthetic(args.large) + bench_trace_loads(args.csv_rows)
    print_and_save(pd.DataFrame(rows), args.out, settings=cli_settings(args), kind="simulator-bench")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
