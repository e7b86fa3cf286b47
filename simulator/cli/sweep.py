"""``python -m simulator sweep`` and ``plan`` (many simulations as Ray tasks) and ``paper`` (the vLLM paper's
figures)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lab.cli.args import (cli_settings, key_values, output_csv, output_file, output_folder, positive_float,
                          positive_int, refuse_ignored, refuse_shared_outputs)
from lab.errors import user_errors
from lab.report.results import print_and_save, with_settings

from simulator.experiments.sweep import failed_runs, load_grid, run_sweep, runs_failing_checks, save_table


def output_table(text: str) -> str:
    """A ``.parquet`` or ``.csv`` path that can be written (checked before any run)."""
    if Path(text).suffix not in (".parquet", ".csv"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a .parquet or .csv file")
    return output_csv(text)


def _ray_options(p: argparse.ArgumentParser) -> None:
    """Where the runs go (a Ray cluster, a local Ray, or this process) and whether a bar shows them."""
    p.add_argument("--address", default=None, help="an existing Ray cluster (default: RAY_ADDRESS, else local)")
    p.add_argument("--num-cpus", type=positive_int, default=None, help="CPUs of the local Ray (default: all)")
    p.add_argument("--serial", action="store_true", help="run in this process, without Ray")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def refuse_ray_options_when_serial(args: argparse.Namespace) -> None:
    """``--address`` and ``--num-cpus`` place Ray's workers; ``--serial`` runs without Ray: refused together."""
    if args.serial:
        refuse_ignored([name for name in ("address", "num_cpus") if getattr(args, name) is not None],
                       "--serial runs in this process, without Ray")


def sweep_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m simulator sweep",
                                description="Run every combination of a grid of SimConfig fields and workload "
                                            "parameters as Ray tasks; finished runs are kept in a store and skipped "
                                            "when the sweep is run again.")
    p.add_argument("--grid", required=True, help="YAML: field -> list of values")
    p.add_argument("--out", type=output_table, required=True, help="results table (.parquet or .csv)")
    p.add_argument("--store", type=output_file, default=None,
                   help="SQLite file of finished runs (default: <out>.store.sqlite)")
    p.add_argument("--no-retry-failed", action="store_true",
                   help="keep the stored result of a run that failed instead of running it again")
    _ray_options(p)
    return p


def sweep_main(argv: list[str]) -> int:
    args = sweep_parser().parse_args(argv)
    args.store = args.store or str(Path(args.out).with_suffix("")) + ".store.sqlite"
    store = args.store
    try:
        refuse_ray_options_when_serial(args)
        grid = load_grid(args.grid)
        read = [(f"the grid's {name} file", value) for name in ("workload", "kernel_csv", "profile")
                for value in grid.get(name, ()) if isinstance(value, str)]
        refuse_shared_outputs(args, "out", "store", inputs=[("the grid", args.grid), *read])
        result = run_sweep(grid, store, parallel=not args.serial, address=args.address, num_cpus=args.num_cpus,
                           progress=not args.no_progress, retry_failed=not args.no_retry_failed,
                           keep_on_interrupt=True)
    except user_errors() as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before any run (reading the grid, opening the store)
        print(f"interrupted before any run; {args.out} not written", file=sys.stderr)
        return 130
    table = result.table
    save_table(with_settings(table, cli_settings(args, "store")), args.out)
    if result.interrupted:  # Ctrl-C: the runs done so far are written, and stored for the next time
        print(f"interrupted after {result.ran} of {result.interrupted} runs; wrote {args.out} ({len(table)} rows); "
              f"run the same command again to run the {result.interrupted - result.ran} missing ones (finished runs "
              f"are kept in {store})", file=sys.stderr)
        return 130
    if result.store_error:
        print(f"warning: the store failed ({result.store_error}); {args.out} holds this invocation's runs",
              file=sys.stderr)
    failed = len(failed_runs(table))
    print(f"{len(table)} runs ({result.ran} run now, {len(table) - result.ran} from {store}); {failed} failed; "
          f"Ray start-up {result.ray_init_s:.1f} s; wrote {args.out}", file=sys.stderr)
    for row in failed_runs(table).head(5).itertuples():
        print(f"warning: run {row.run_key} failed: {row.error}", file=sys.stderr)
    for row in runs_failing_checks(table).head(5).itertuples():
        print(f"warning: run {row.run_key} broke {row.checks_failed} closed-form check(s) (a simulator bug; rerun "
              f"it with `python -m simulator --checks` to see which)", file=sys.stderr)
    return 1 if failed == len(table) else 0


MAX_LIST = 4096  # values in one list option: a sweep grid multiplies them


def int_list(text: str) -> list[int]:
    """``1,2,4`` or a range ``1..16`` of integers >= 1 (at most ``MAX_LIST`` of them)."""
    try:
        if ".." in text:
            low, high = (int(part) for part in text.split(".."))
            if high - low + 1 > MAX_LIST:  # checked before the range is built
                raise argparse.ArgumentTypeError(f"{text!r} has {high - low + 1} values; at most {MAX_LIST}")
            values = list(range(low, high + 1))
        else:
            values = [int(part) for part in text.split(",") if part.strip()]
            if len(values) > MAX_LIST:
                raise argparse.ArgumentTypeError(f"{len(values)} values; at most {MAX_LIST}")
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1,2,4 or a range 1..16, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1 like 1,2,4 or 1..16, got {text!r}")
    return values


def gib_list(text: str) -> list[float]:
    """``0,32,128``: sizes in GiB, each finite and >= 0."""
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of GiB, got {text!r}") from None
    if not values or any(not 0 <= v < float("inf") for v in values):
        raise argparse.ArgumentTypeError(f"expected finite sizes >= 0 GiB, got {text!r}")
    return values


def kv_dtype_list(text: str) -> list[str]:
    """``auto,fp8``: KV cache element types (``lab.kv_cache.precision.KV_CACHE_DTYPES``)."""
    from simulator.core.engine import KV_CACHE_DTYPES

    values = name_list(text)
    unknown = [v for v in values if v not in KV_CACHE_DTYPES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown KV cache dtype {unknown[0]!r:.40}; expected {', '.join(KV_CACHE_DTYPES)}")
    return values


def name_list(text: str) -> list[str]:
    values = [part.strip() for part in text.split(",") if part.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
    return values


def prices(text: str) -> dict[str, float]:
    """``a100-80gb=3.5,h100-80gb=6`` (USD per GPU-hour): known GPU presets, each once."""
    from lab.errors import InputError

    from simulator.core.models import GPUS

    try:
        pairs = key_values(text, "--gpu-price")
    except InputError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    out = {}
    for name, value in pairs.items():
        if name not in GPUS:
            raise argparse.ArgumentTypeError(f"--gpu-price: unknown GPU {name!r}; GPU presets: {', '.join(GPUS)}")
        try:
            out[name] = positive_float(value)
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"expected gpu=price per hour, got {name}={value!r}") from None
    return out


def plan_parser() -> argparse.ArgumentParser:
    from simulator.experiments.plan import HOST_PRICE_PER_GIB_HOUR, SLO_METRICS

    p = argparse.ArgumentParser(prog="python -m simulator plan",
                                description="For each configuration, the highest request rate meeting every SLO "
                                            "(binary search; the workload's arrivals scaled), its cost per hour, and "
                                            "the cheapest configuration meeting --target-rate.")
    p.add_argument("--workload", default="sharegpt", help="synthetic preset or trace path")
    p.add_argument("--num-requests", type=positive_int, default=1000, help="requests (trace: first rows)")
    p.add_argument("--slo", required=True, help=f"limits in seconds, e.g. ttft_p90=2,tpot_p90=0.2 "
                                                f"({', '.join(SLO_METRICS)})")
    p.add_argument("--models", type=name_list, default=["qwen3-8b"], help="comma list of model presets")
    p.add_argument("--gpus", type=name_list, default=["a100-80gb"], help="comma list of GPU presets")
    p.add_argument("--tp", type=int_list, default=[1], help="comma list of tensor-parallel degrees (GPUs per replica)")
    p.add_argument("--replicas", type=int_list, default=[1], help="comma list of replica counts behind the router")
    p.add_argument("--allocators", type=name_list, default=["paged", "contiguous-oracle"],
                   help="comma list of KV allocators")
    p.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block (paged)")
    p.add_argument("--router", default="round-robin", choices=["round-robin", "least-loaded", "random"],
                   help="how requests are spread over replicas")
    p.add_argument("--max-model-len", type=positive_int, default=2048, help="longest prompt + output")
    p.add_argument("--target-rate", type=positive_float, default=None, help="req/s the chosen configuration must "
                                                                          "sustain")
    p.add_argument("--gpu-price", type=prices, default={}, help="override prices: gpu=USD per GPU-hour,...")
    p.add_argument("--kv-cache-dtype", type=kv_dtype_list, default=["auto"],
                   help="comma list of KV cache element types to try: auto (the model's dtype), fp8 (one byte, "
                        "twice the tokens per GiB: vLLM's --kv-cache-dtype)")
    p.add_argument("--kv-offload-gib", type=gib_list, default=[0.0],
                   help="comma list of host offload tier sizes per replica to try, GiB (paged allocators)")
    p.add_argument("--host-price", type=positive_float, default=HOST_PRICE_PER_GIB_HOUR,
                   help="USD per GiB-hour of host memory (prices the offload tier)")
    p.add_argument("--rate-start", type=positive_float, default=1.0, help="first rate tried (req/s)")
    p.add_argument("--tolerance", type=positive_float, default=0.02, help="stop when rates are this close")
    p.add_argument("--out", type=output_table, default=None, help="results table (.parquet or .csv)")
    _ray_options(p)
    return p


def plan_main(argv: list[str]) -> int:
    from simulator.experiments.plan import RateSearch, parse_slos, plan_capacity

    args = plan_parser().parse_args(argv)
    try:
        refuse_shared_outputs(args, "out", inputs=[("the trace", args.workload)])
        refuse_ray_options_when_serial(args)
        if max(args.replicas) == 1:
            refuse_ignored(["router"] if args.router != plan_parser().get_default("router") else [],
                           "--router shares requests among --replicas (more than 1)")
        slos = parse_slos(args.slo)
        result = plan_capacity({"workload": args.workload, "num_requests": args.num_requests}, args.slo,
                               args.models, args.gpus, args.tp, args.replicas, args.allocators, args.target_rate,
                               args.gpu_price, RateSearch(args.rate_start, args.tolerance), parallel=not args.serial,
                               address=args.address, num_cpus=args.num_cpus, progress=not args.no_progress,
                               offload_gib=args.kv_offload_gib, host_price_per_gib_hour=args.host_price,
                               block_size=args.block_size, router=args.router, max_model_len=args.max_model_len,
                               kv_cache_dtypes=args.kv_cache_dtype)
    except user_errors() as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    table = result.table
    print_and_save(table, None, [c for c in ("model", "gpu", "tp", "replicas", "allocator", "kv_cache_dtype",
                                             "kv_offload_gib",
                                             "max_rate_req_s", "search_bound",
                                             "cost_per_hour", "cost_per_million_requests", "chosen", *slos)])
    if args.out:
        save_table(with_settings(table, cli_settings(args)), args.out)
    for row in failed_runs(table).head(5).itertuples():
        print(f"warning: {row.model} on {row.tp} x {row.gpu}, {row.allocator}: {row.error}", file=sys.stderr)
    capped = table[table["first_failing_rate_req_s"] == float("inf")]
    if len(capped):
        print(f"warning: {len(capped)} configuration(s) met the SLOs at every rate tried (up to "
              f"{capped['max_rate_req_s'].max():.3g} req/s): {args.num_requests} requests are too few to load them; "
              f"plan with more --num-requests", file=sys.stderr)
    chosen = table[table["chosen"]]
    if chosen.empty:
        unmeetable = (table["search_bound"] == "no rate meets the SLOs").all() if "search_bound" in table else False
        lowest = table["first_failing_rate_req_s"].min()
        print("no configuration meets the SLOs" + (f" at {args.target_rate} req/s" if args.target_rate else "") +
              (f": the SLOs are unmeetable here, every configuration failed them even at the lowest rate simulated "
               f"({lowest:.3g} req/s)" if unmeetable else ""), file=sys.stderr)
        return 1
    best = chosen.iloc[0]
    print(f"chosen: {best['model']} on {best['tp']} x {best['gpu']} x {best['replicas']} replicas, "
          f"{best['allocator']}, KV cache {best.get('kv_cache_dtype', 'auto')}: up to {best['max_rate_req_s']:.2f} "
          f"req/s for ${best['cost_per_hour']:.2f}/h",
          file=sys.stderr)
    return 0


def paper_parser() -> argparse.ArgumentParser:
    from simulator.experiments.paper import FIGURES

    p = argparse.ArgumentParser(prog="python -m simulator paper",
                                description="The vLLM paper's figures: the simulator's numbers beside the paper's, "
                                            "one CSV per figure and summary.csv (figure, quantity, paper, lab, "
                                            "verdict).")
    p.add_argument("--figure", default="all", choices=[*FIGURES, "all"], help="one figure, or all of them")
    p.add_argument("--out", type=output_folder, default="benchmarks/results/paper", help="folder for the CSVs")
    p.add_argument("--no-tiny", action="store_true",
                   help="skip the real tiny-engine runs beside Figures 18 and 19 (they take minutes on a CPU)")
    p.add_argument("--num-requests", type=positive_int, default=2000, help="requests per simulated workload")
    return p


def paper_main(argv: list[str]) -> int:
    from simulator.experiments.paper import FIGURES, TINY, run_figures

    args = paper_parser().parse_args(argv)
    try:
        if args.no_tiny and args.figure not in ("all", "18", "19"):
            refuse_ignored(["no_tiny"], "it drops the tiny model from figures 18 and 19 only")
        summary = run_figures(list(FIGURES) if args.figure == "all" else [args.figure], args.out, args.num_requests,
                              None if args.no_tiny else TINY)
    except user_errors() as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_and_save(summary, None)
    print(f"wrote {args.out}/summary.csv and one CSV per figure", file=sys.stderr)
    return 0
