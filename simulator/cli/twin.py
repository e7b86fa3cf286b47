"""``python -m simulator twin`` and ``python -m simulator twin-bench``: the real engine and the simulator on the
engine's measured profile, side by side (the twin joins the two, so it lives above both)."""
from __future__ import annotations

import argparse
import sys

from lab.cli.args import (DEVICE_HELP, cli_settings, device, model_options, non_negative_int, output_csv,
                          positive_float, positive_int, refuse_ignored, refuse_shared_outputs, run_command,
                          scheduler_options, scheduling_settings)
from lab.errors import InputError
from lab.report.results import print_and_save, save_csv, settings_of


def _bench_twin(args) -> None:
    from simulator.twins.twin import bench_twin

    table = bench_twin(args.models.split(","), args.repeats, device=args.device, light_fraction=args.light_fraction,
                       progress=lambda message: print(message, file=sys.stderr))
    print_and_save(table, args.out, settings=cli_settings(args), kind="twin-bench")


# the engine twin's defaults for the options whose default differs with --peer vllm (VLLMTwinConfig's)
ENGINE_DEFAULTS = {"block_size": 16, "num_blocks": 256, "max_num_seqs": 256, "max_num_batched_tokens": 8192,
                   "scheduling": "prefill-first"}


def _twin(args) -> None:
    from lab.engine import EngineConfig
    from lab.profiling.profile import Profile, extrapolation_warning

    from simulator.twins.twin import TwinConfig, run_twin, twin_workload

    if args.peer == "vllm":
        return _vllm_twin(args)
    refuse_ignored([name for name in VLLM_ONLY if getattr(args, name) is not None]
                   + ([] if args.pin_client else ["pin_client"]), "they are for --peer vllm")
    if args.profile is None:
        raise InputError("--profile is required (from python -m lab profile), unless --peer vllm measures one")
    for name, value in ENGINE_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    refuse_shared_outputs(args, "out", "steps_out", inputs=[("the profile", args.profile), ("the trace", args.workload),
                                                             ("the checkpoint", args.model)])
    lengths = {name: getattr(args, name) for name in ("input_len", "output_len") if getattr(args, name) is not None}
    if args.workload not in ("random", "fixed"):
        refuse_ignored(list(lengths), f"only the random and fixed presets take lengths ({args.workload} brings its "
                                      f"own)")
    profile = Profile.load(args.profile)
    workload = twin_workload(args.workload, args.num_requests, args.rate, time_scale=args.time_scale, seed=args.seed,
                             **lengths)  # twin_workload's defaults for the lengths not given
    engine = EngineConfig(block_size=args.block_size, num_blocks=args.num_blocks, **scheduling_settings(args),
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


VLLM_ONLY = ("url", "workloads", "length_scale", "profile_grid")


def _vllm_twin(args) -> None:
    import tempfile

    import torch

    from lab.models.qwen3 import checkpoint_dir
    from lab.profiling.profile import Profile, extrapolation_warning

    from simulator.twins.vllm_twin import WORKLOADS, VLLMTwinConfig, run_vllm_twin, settings_of as twin_settings

    ignored = [name for name in ("steps_out", "input_len", "output_len", "kv_offload_blocks") if getattr(args, name)]
    ignored += ["pin_client"] if args.url and not args.pin_client else []  # a server of its own is not pinned
    ignored += [name for name, default in (("workload", "random"), ("backend", "auto"), ("time_scale", 1.0),
                                           ("scheduling", None), ("device", None)) if getattr(args, name) != default]
    refuse_ignored(ignored, "the vLLM twin runs vLLM V1's policy on the CPU on its own workloads (--workloads)")
    defaults = VLLMTwinConfig()
    config = VLLMTwinConfig(
        model=args.model, block_size=args.block_size or defaults.block_size,
        num_blocks=args.num_blocks or defaults.num_blocks, max_num_seqs=args.max_num_seqs or defaults.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens or defaults.max_num_batched_tokens,
        workloads=WORKLOADS if args.workloads == "all" else tuple(
            (args.workloads or ",".join(defaults.workloads)).split(",")),
        num_requests=args.num_requests, rate=args.rate if args.rate is not None else defaults.rate,
        length_scale=args.length_scale or defaults.length_scale, repeats=args.repeats,
        grid=args.profile_grid or defaults.grid, seed=args.seed, url=args.url, pin_client=args.pin_client)
    for name in config.workloads:
        if name not in WORKLOADS:
            raise InputError(f"--workloads: {name!r} is not one of {', '.join(WORKLOADS)}")
    profile = Profile.load(args.profile) if args.profile else None
    with tempfile.TemporaryDirectory(prefix="minipaged-twin-") as folder:
        checkpoint = checkpoint_dir(args.model, folder, getattr(torch, config.dtype))
        result = run_vllm_twin(config, checkpoint, profile, progress=lambda message: print(message, file=sys.stderr))
    calibration = result.calibration
    settings = {**twin_settings(config), "step_overhead_s": calibration.step_overhead_s,
                "prefill_token_overhead_s": calibration.prefill_token_overhead_s,
                "prefill_token_at_bound": calibration.prefill_token_at_bound,
                "request_overhead_s": calibration.request_overhead_s,
                "request_overhead_per_token_s": calibration.request_overhead_per_token_s,
                "request_interval_s": calibration.request_interval_s,
                "request_interval_at_bound": calibration.interval_at_bound,
                "profile_holdout_median_rel_error": result.profile.holdout_median_rel_error}
    print_and_save(result.summary(), args.out, settings=settings, kind="vllm-twin")
    for (name, repeat), run in result.runs.items():
        if run.problems:
            print(f"{name}, run {repeat + 1}: {'; '.join(run.problems)}", file=sys.stderr)
    for name, beyond in result.extrapolation().items():
        print(f"warning: {name}: {extrapolation_warning(beyond)}", file=sys.stderr)


def twin_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m simulator", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    t = commands.add_parser("twin", help="one workload through the engine and the simulator on its profile")
    model_options(t)
    t.add_argument("--profile", default=None, help="from python -m lab profile: required for the engine's twin; "
                                                    "with --peer vllm, from python -m lab profile --peer vllm, or "
                                                    "measured first when not given")
    t.add_argument("--peer", choices=["vllm"], default=None,
                   help="predict a real vLLM server instead of our engine: calibrate on vLLM's engine, start its "
                        "server on 127.0.0.1 (or use --url), score the simulator on --workloads; block size, pool and "
                        "budgets default to 32, 256 blocks, 16 sequences and 512 tokens")
    t.add_argument("--pin-client", action=argparse.BooleanOptionalAction, default=True,
                   help="--peer vllm, a server started here: run the lab's process (client, simulator) on the cores "
                        "vLLM's worker leaves to its API process (--no-pin-client: anywhere, to measure the spread "
                        "without)")
    t.add_argument("--url", default=None, help="--peer vllm: a vLLM server already running (not started, not stopped)")
    t.add_argument("--workloads", default=None,
                   help="--peer vllm: comma-separated, of all-at-once, prefix, poisson, gamma, azure, or all "
                        "(default: all-at-once,prefix,poisson)")
    t.add_argument("--length-scale", type=positive_float, default=None,
                   help="--peer vllm: ShareGPT-like lengths times this (default 0.25)")
    t.add_argument("--profile-grid", choices=["full", "small", "quick"], default=None,
                   help="--peer vllm: the calibration's scenarios (default small)")
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
    t.add_argument("--num-blocks", type=positive_int, default=None, help="KV pool in blocks (default 256)")
    scheduler_options(t)
    t.set_defaults(block_size=None, max_num_seqs=None, max_num_batched_tokens=None, scheduling=None)
    t.add_argument("--kv-offload-blocks", type=non_negative_int, default=0,
                   help="host slots of the prefix cache's offload tier (0: none)")
    t.add_argument("--repeats", type=positive_int, default=1, help="real runs (2+: the noise floor; --peer vllm: "
                                                                   "runs per workload, 3 for the spread)")
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
