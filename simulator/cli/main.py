"""``python -m simulator``: replay a workload against several KV allocators and block sizes (``sweep`` and
``plan`` subcommands: many runs on Ray, see ``simulator.cli.sweep``; ``paper``: the vLLM paper's figures; ``twin`` and
``twin-bench``: the real engine beside the simulator, ``simulator.cli.twin``)."""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import pandas as pd
from tqdm import tqdm

from lab.errors import InputError, user_errors
from lab.cli.args import (non_negative_int, output_csv, positive_float, positive_int, positive_ints, refuse_ignored,
                           refuse_shared_outputs, scheduler_options, scheduling_settings)
from lab.profiling.profile import extrapolation_warning
from lab.report.results import print_and_save, save_csv

from simulator.core.allocators import ALLOCATORS
from simulator.core.runs import compare, make_workload
from simulator.core.checks import closed_form_checks
from simulator.core.engine import KV_CACHE_DTYPES, SimConfig
from simulator.core.metrics import rejection_warning
from simulator.core.models import GPUS, MODELS
from simulator.core.presets import PAPER_FIGURE2_TOKEN_STATES, figure2_experiment, make_configs
from simulator.views.report import run_settings
from simulator.core.workloads import SYNTHETIC_PRESETS, SyntheticSpec, synthetic_workload

SUMMARY_COLUMNS = ["allocator", "block_size", "token_states_frac", "reserved_frac", "internal_fragmentation_frac",
                   "external_fragmentation_frac", "free_frac", "mean_batch_size", "throughput_tok_s", "preemptions",
                   "num_requests_completed", "num_requests_rejected", "wall_time_s"]


def _csv_list(kind):
    def parse(text: str):
        try:
            return [kind(x) for x in text.split(",") if x]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}") from None
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m simulator", description=__doc__)
    p.add_argument("--workload", default="sharegpt", help=f"preset ({', '.join(SYNTHETIC_PRESETS)}) or trace path")
    p.add_argument("--preset", choices=["figure2"], help="a ready-made experiment (overrides allocators/model/gpu)")
    p.add_argument("--allocators", type=_csv_list(str), default=list(ALLOCATORS),
                   help=f"comma list of {', '.join(ALLOCATORS)} (default: all)")
    p.add_argument("--block-size", type=positive_ints, default=[16], help="comma list for sweeps (paged)")
    p.add_argument("--model", default="qwen3-8b", choices=sorted(MODELS),
                   help="model preset (KV bytes, FLOPs, weights)")
    p.add_argument("--gpu", default="a100-80gb", choices=sorted(GPUS), help="GPU preset (memory, FLOP/s, bandwidth)")
    p.add_argument("--max-model-len", type=positive_int, default=2048,
                   help="longest prompt + output (contiguous-max reserves this much)")
    p.add_argument("--rate", type=float, default=math.inf,
                   help="requests/s: a preset's arrival rate (inf = all at t=0), or a trace's arrivals rescaled to it")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps (1 = Poisson)")
    p.add_argument("--num-requests", type=positive_int, default=None, help="synthetic count, or max rows of a trace")
    p.add_argument("--n", type=positive_int, default=1, help="parallel samples per request (synthetic)")
    p.add_argument("--beam-width", type=positive_int, default=1,
                   help="beam search of this width per request (synthetic; a seeded survival model)")
    p.add_argument("--shared-prefix", type=non_negative_int, default=0,
                   help="system-prompt tokens shared by all (synthetic)")
    p.add_argument("--time-scale", type=positive_float, default=1.0, help="multiply trace arrival offsets by this")
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="the KV cache's element type: auto (the model's dtype) or fp8 (one byte per element, twice the "
                        "tokens per GiB; vLLM's --kv-cache-dtype)")
    p.add_argument("--capacity-tokens", type=positive_int, default=None, help="override the KV capacity")
    p.add_argument("--num-blocks", type=positive_int, default=None,
                   help="the KV pool in blocks (capacity = blocks x the one --block-size), as the engine's")
    p.add_argument("--profile", default=None, help="step times from `python -m lab profile` instead of the roofline")
    scheduler_options(p)
    p.add_argument("--kv-offload-gib", type=float, default=0.0,
                   help="host memory (GiB) of the prefix cache's offload tier (paged with prefix caching; inf: "
                        "unbounded; 0: none), in blocks of the model's KV")
    p.add_argument("--address-space", default="first-fit", choices=["first-fit", "buddy"],
                   help="how contiguous regions are placed")
    p.add_argument("--no-prefix-caching", action="store_true", help="paged: no reuse of cached prompt blocks")
    p.add_argument("--replicas", type=positive_int, default=1, help="copies of each configuration behind a router")
    p.add_argument("--router", default="round-robin", choices=["round-robin", "least-loaded", "random"],
                   help="how --replicas share the requests")
    p.add_argument("--kernel-csv", default=None, help="calibrate attention bandwidth from a kernel bench CSV")
    p.add_argument("--max-points", type=positive_int, default=2000, help="timeseries rows kept per run (decimated)")
    p.add_argument("--seed", type=non_negative_int, default=0, help="seeds the synthetic workload")
    p.add_argument("--out", type=output_csv, default=None, help="summary CSV")
    p.add_argument("--timeseries", type=output_csv, default=None, help="timeseries CSV (all runs, tagged)")
    p.add_argument("--checks", type=output_csv, default=None,
                   help="CSV of the closed-form checks of every run (simulator.core.checks); a count is always printed")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


SYNTHETIC_OPTIONS = ("burstiness", "n", "beam_width", "shared_prefix", "seed")  # --rate rescales a trace's arrivals
ROOFLINE_OPTIONS = ("model", "gpu", "kernel_csv", "address_space")
# what --preset figure2 leaves to the command line; it fixes every other option (``presets.figure2_experiment``)
FIGURE2_OPTIONS = ("preset", "num_requests", "seed", "out", "timeseries", "checks", "no_progress")


def check_options(args) -> None:
    """Raise ``ValueError`` naming any option the chosen workload or clock would ignore: synthetic-preset options
    with a trace file, ``--time-scale`` with a preset, roofline options or a contiguous allocator with ``--profile``,
    ``--router`` without replicas, anything but the count and seed with ``--preset figure2``."""
    parser = build_parser()
    changed = [name for name, value in vars(args).items() if value != parser.get_default(name)]

    def given(names) -> list[str]:
        return [name for name in changed if name in names]

    if args.preset == "figure2":
        refuse_ignored([name for name in changed if name not in FIGURE2_OPTIONS],
                       "--preset figure2 fixes its workload and configurations (OPT-13B on an A100-40GB, ShareGPT "
                       "lengths at t = 0, buddy-allocated baselines, paged B=16); only --num-requests and --seed "
                       "change it")
    elif args.workload in SYNTHETIC_PRESETS:
        refuse_ignored(given(["time_scale"]),
                       f"--time-scale scales a trace's arrivals; the {args.workload} preset's come from --rate")
    elif Path(args.workload).exists():  # else make_workload says it is neither a preset nor a file
        refuse_ignored(given(SYNTHETIC_OPTIONS), f"{args.workload} is a trace: it keeps its own arrivals and lengths, "
                       f"one sample per request (scale its arrivals with --rate or --time-scale)")
        if given(["rate"]):
            refuse_ignored(given(["time_scale"]), "--rate sets the trace's mean arrival rate")
    if args.profile is not None:
        allocators = ["allocators"] if given(["allocators"]) and args.allocators != ["paged"] else []
        refuse_ignored(given(ROOFLINE_OPTIONS) + allocators,
                       "--profile prices the paged engine it measured, in place of the model and GPU roofline")
    if args.replicas == 1:
        refuse_ignored(given(["router"]), "--router shares requests among --replicas (more than 1)")
    if args.timeseries is None:
        refuse_ignored(given(["max_points"]), "it thins the timeseries, and no --timeseries is written")


def _workload(args):
    check_options(args)
    if args.preset == "figure2":
        spec, _ = figure2_experiment(args.num_requests or 1000, args.seed)
        return synthetic_workload(spec)
    if args.workload in SYNTHETIC_PRESETS:
        return synthetic_workload(SyntheticSpec(preset=args.workload, num_requests=args.num_requests or 1000,
                                                rate=args.rate, burstiness=args.burstiness, n=args.n,
                                                beam_width=args.beam_width,
                                                shared_prefix_tokens=args.shared_prefix,
                                                max_model_len=args.max_model_len, seed=args.seed))
    return make_workload(args.workload, num_requests=args.num_requests, time_scale=args.time_scale, rate=args.rate)


def _configs(args) -> list[SimConfig]:
    if args.preset == "figure2":
        return figure2_experiment()[1]
    capacity = args.capacity_tokens
    if args.num_blocks is not None:
        if len(args.block_size) != 1 or capacity is not None:
            raise InputError("--num-blocks needs exactly one --block-size and no --capacity-tokens")
        capacity = args.num_blocks * args.block_size[0]
    if args.profile is not None:
        from lab.profiling.profile import Profile

        profile = Profile.load(args.profile)
        if capacity is None:
            raise InputError("--profile needs the engine's pool: --num-blocks (or --capacity-tokens)")
        return make_configs(["paged"], args.block_size, profile=profile, capacity_tokens=capacity,
                            max_model_len=args.max_model_len, **scheduling_settings(args),
                            kv_cache_dtype=args.kv_cache_dtype,
                            enable_prefix_caching=not args.no_prefix_caching, max_points=args.max_points,
                            replicas=args.replicas, router=args.router, kv_offload_gib=args.kv_offload_gib)
    return make_configs(args.allocators, args.block_size, model=args.model, gpu=args.gpu,
                        max_model_len=args.max_model_len, capacity_tokens=capacity,
                        address_space=args.address_space, **scheduling_settings(args),
                        kv_cache_dtype=args.kv_cache_dtype,
                        enable_prefix_caching=not args.no_prefix_caching, kernel_csv=args.kernel_csv,
                        max_points=args.max_points, replicas=args.replicas, router=args.router,
                        kv_offload_gib=args.kv_offload_gib)


def run(args) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, dict]:
    """The summary (a row per configuration), the tagged timeseries and the closed-form checks of every run, and the
    settings they share (``report.run_settings``)."""
    workload, configs = _workload(args), _configs(args)  # bad input fails before the progress bar starts
    bar = tqdm(total=100, desc="simulating", unit="%", file=sys.stderr, disable=args.no_progress)
    summary, results = compare(workload, configs, progress=lambda done: bar.update(int(done * 100) - bar.n))
    bar.update(100 - bar.n)
    bar.close()
    if args.preset == "figure2":
        summary["paper_token_states_frac"] = summary["allocator"].map(PAPER_FIGURE2_TOKEN_STATES)
    series = [r.timeseries.assign(allocator=r.config.allocator, block_size=r.config.block_size)
              for r in results.values()]
    return (summary, pd.concat(series, ignore_index=True), closed_form_checks(workload, results),
            run_settings(workload, configs))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("sweep", "plan", "paper"):
        from . import sweep as cli_sweep

        return getattr(cli_sweep, f"{argv[0]}_main")(argv[1:])
    if argv and argv[0] in ("twin", "twin-bench"):
        from .twin import twin_main

        return twin_main(argv)
    args = build_parser().parse_args(argv)
    try:
        refuse_shared_outputs(args, "out", "timeseries", "checks", inputs=[
            ("the trace", args.workload), ("the profile", args.profile), ("the kernel CSV", args.kernel_csv)])
        summary, timeseries, checks, settings = run(args)
    except user_errors() as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    columns = SUMMARY_COLUMNS + [c for c in ("paper_token_states_frac",) if c in summary]
    print_and_save(summary, args.out, columns, settings, "summary")
    save_csv(timeseries, args.timeseries, settings, "timeseries")
    save_csv(checks, args.checks, settings, "checks")
    print(f"closed-form checks: {int(checks['holds'].sum())} of {len(checks)} hold", file=sys.stderr)
    for row in checks[~checks["holds"]].itertuples():
        print(f"warning: {row.label}: {row.check}: simulated {row.simulated:.6g}, closed form {row.relation} "
              f"{row.closed_form:.6g}", file=sys.stderr)
    for row in summary.itertuples():
        if row.num_requests_rejected:
            print(f"warning: {rejection_warning(row)}", file=sys.stderr)
        if getattr(row, "profile_extrapolation", ""):  # a profile-priced run outside the profile's grid
            print(f"warning: {row.label}: {extrapolation_warning(row.profile_extrapolation)}", file=sys.stderr)
    if (summary["num_requests_completed"] == 0).all():
        print("error: no request completed in any configuration (see the rejections above)", file=sys.stderr)
        return 1
    return 0
