"""``python -m simulator twin`` and ``python -m simulator twin-bench``: the real engine and the simulator on the
engine's measured profile, side by side (the twin joins the two, so it lives above both)."""
from __future__ import annotations

import argparse
import sys

from lab.cli_args import (DEVICE_HELP, cli_settings, device, model_options, non_negative_int, output_csv,
                          positive_float, positive_int, refuse_ignored, refuse_shared_outputs, run_command,
                          scheduler_options)
from lab.results import print_and_save, save_csv, settings_of


def _bench_twin(args) -> None:
    from .twin import bench_twin

    table = bench_twin(args.models.split(","), args.repeats, device=args.device, light_fraction=args.light_fraction,
                       progress=lambda message: print(message, file=sys.stderr))
    print_and_save(table, args.out, settings=cli_settings(args), kind="twin-bench")


def _twin(args) -> None:
    from lab.engine import EngineConfig
    from lab.profile import Profile, extrapolation_warning

    from .twin import TwinConfig, run_twin, twin_workload

    refuse_shared_outputs(args, "out", "steps_out")
    lengths = {name: getattr(args, name) for name in ("input_len", "output_len") if getattr(args, name) is not None}
    if args.workload not in ("random", "fixed"):
        refuse_ignored(list(lengths), f"only the random and fixed presets take lengths ({args.workload} brings its "
                                      f"own)")
    profile = Profile.load(args.profile)
    workload = twin_workload(args.workload, args.num_requests, args.rate, time_scale=args.time_scale, seed=args.seed,
                             **lengths)  # twin_workload's defaults for the lengths not given
    engine = EngineConfig(block_size=args.block_size, num_blocks=args.num_blocks, scheduling=args.scheduling,
                          preemption_mode=args.preemption_mode, num_cpu_blocks=args.num_cpu_blocks,
                          max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          device=args.device, attention_backend=args.backend, seed=args.seed,
                          kv_offload_blocks=args.kv_offload_blocks)
    config = TwinConfig(args.model, engine)
    result = run_twin(workload, config, profile, args.repeats)
    settings = settings_of(config, workload.summary(), profile=args.profile, repeats=args.repeats)
    print_and_save(result.table, args.out, settings=settings, kind="twin")
    save_csv(result.steps_table(), args.steps_out, settings, "twin-steps")
    through_run = result.pricing_through_run()
    if not through_run.empty:
        print("measured / modelled step time through the run (a climb: steps slow under sustained load):")
        print(through_run.to_string(index=False, float_format=lambda value: f"{value:.4g}"))
    if result.first_difference:
        print(f"schedules differ at {result.first_difference}")
    if result.extrapolation:
        print(f"warning: {extrapolation_warning(result.extrapolation)}", file=sys.stderr)


def twin_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m simulator", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    t = commands.add_parser("twin", help="one workload through the engine and the simulator on its profile")
    model_options(t)
    t.add_argument("--profile", required=True, help="from python -m lab profile")
    t.add_argument("--workload", default="random",
                   help="random or fixed (--input-len/--output-len), another preset, or a trace file")
    t.add_argument("--num-requests", type=positive_int, default=32, help="requests drawn, or a trace's first rows")
    t.add_argument("--rate", type=float, default=None,
                   help="req/s: a preset's arrival rate (default inf: all at t=0), or a trace's rescaled to it")
    t.add_argument("--time-scale", type=positive_float, default=1.0, help="multiply a trace's arrival offsets")
    t.add_argument("--input-len", type=positive_int, default=None,
                   help="prompt tokens of random (the mean, +-50 %%) or fixed (default 96)")
    t.add_argument("--output-len", type=positive_int, default=None,
                   help="output tokens of random (the mean, +-50 %%) or fixed (default 32)")
    t.add_argument("--num-blocks", type=positive_int, default=256, help="KV pool in blocks")
    scheduler_options(t)
    t.add_argument("--kv-offload-blocks", type=non_negative_int, default=0,
                   help="host slots of the prefix cache's offload tier (0: none)")
    t.add_argument("--repeats", type=positive_int, default=1, help="real runs (2+: the noise floor)")
    t.add_argument("--seed", type=non_negative_int, default=0, help="seeds the workload, prompts and engine")
    t.add_argument("--out", type=output_csv, default=None, help="CSV: metric, real, simulated, rel_error")
    t.add_argument("--steps-out", type=output_csv, default=None,
                   help="CSV of the real run's steps with each step's modelled time beside its measured one")
    t.set_defaults(run=_twin)

    w = commands.add_parser("twin-bench", help="fidelity of the simulator on the engine's profile (saturated, light, chunked)")
    w.add_argument("--models", default="tiny,qwen3-0.6b-random-4l", help="comma-separated presets (see BENCH_MODELS)")
    w.add_argument("--light-fraction", type=positive_float, default=None,
                   help="light load = this fraction of the saturated run's request throughput; default: the model's")
    w.add_argument("--repeats", type=positive_int, default=None,
                   help="profile rounds and real runs per load (median; spread = noise floor); default: the model's")
    w.add_argument("--device", type=device, default=None, help=DEVICE_HELP)
    w.add_argument("--out", type=output_csv, default="benchmarks/results/twin_cpu.csv", help="results CSV")
    w.set_defaults(run=_bench_twin)
    return parser


def twin_main(argv: list[str]) -> int:
    return run_command(twin_parser(), argv)
