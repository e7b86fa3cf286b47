"""``python -m lab``: benchmarks and generation from the command line."""
from __future__ import annotations

import argparse
import sys

import pandas as pd

from .errors import InputError
from lab.cli_args import (cli_settings, device, non_negative_int, output_csv, positive_float, positive_int,
                          positive_ints, refuse_ignored)
from lab.profile import GRIDS
from lab.results import print_and_save, save_csv, settings_of


def _bench_kernels(args) -> None:
    import torch
    from tqdm import tqdm

    from lab.bench.kernels import KernelBenchConfig, run_kernel_bench

    import pandas as pd

    dtypes = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    bar = tqdm(total=len(args.block_size) * len(args.batch) * len(args.context), desc="kernel bench",
               file=sys.stderr)
    tables = []
    for block_size in args.block_size:  # several: the simulator reads the slowdown per block size from the CSV
        config = KernelBenchConfig(device=args.device, dtype=dtypes[args.dtype], batch_sizes=args.batch,
                                   context_lens=args.context, block_size=block_size,
                                   backends=tuple(args.backends.split(",")), repeats=args.repeats)
        tables.append(run_kernel_bench(config, progress=lambda done, total: bar.update(1)))
    bar.close()
    print_and_save(pd.concat(tables, ignore_index=True), args.out, settings=cli_settings(args), kind="kernels")


def _headlines(args) -> None:
    from lab.results import headline_markdown

    print(headline_markdown())


def _bench_block_manager(args) -> None:
    from lab.bench.block_manager import run_block_manager_bench

    print_and_save(run_block_manager_bench(args.block_size), args.out, settings=cli_settings(args),
                   kind="block-manager")


def _bench_e2e(args) -> None:
    from tqdm import tqdm

    from lab.bench.e2e import E2EConfig, run_e2e_bench

    config = E2EConfig(model=args.model, num_requests=args.num_requests, device=args.device,
                       block_size=args.block_size, attention_backend=args.backend,
                       systems=tuple(args.systems.split(",")), repeats=args.repeats)
    bar = tqdm(total=len(config.systems), desc="e2e bench", file=sys.stderr)
    table = run_e2e_bench(config, progress=lambda done, total: bar.update(1))
    bar.close()
    print_and_save(table, args.out, settings=settings_of(config), kind="e2e")


def _generate(args) -> None:
    import torch

    from lab.engine import LLMEngine, SamplingParams

    if args.prompt:
        refuse_ignored([name for name in ("num_prompts", "prompt_len") if getattr(args, name) is not None],
                       "they shape random prompts, and --prompt gives them")
    engine = LLMEngine(args.model, block_size=args.block_size, num_blocks=args.num_blocks, device=args.device,
                       attention_backend=args.backend, enable_prefix_caching=not args.no_prefix_caching,
                       scheduling=args.scheduling, preemption_mode=args.preemption_mode,
                       max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                       num_cpu_blocks=args.num_cpu_blocks)
    if args.prompt:
        prompts = [p if engine.tokenizer is not None else _token_ids(p) for p in args.prompt]
    else:
        generator = torch.Generator().manual_seed(args.seed)
        vocab = engine.hf_model.config.vocab_size
        prompts = [torch.randint(0, vocab, (args.prompt_len or 64,), generator=generator).tolist()
                   for _ in range(args.num_prompts or 8)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, n=args.n)
    for output in engine.generate(prompts, params, progress=True):
        print(f"[{output.request_id}] {output.text if output.text is not None else output.token_ids}")
    metrics = pd.DataFrame([engine.run_metrics()])
    print_and_save(metrics, args.out, settings=cli_settings(args), kind="generate")


def _bench_twin(args) -> None:
    from simulator.twin import bench_twin  # the twin joins engine and simulator (see _twin)

    table = bench_twin(args.models.split(","), args.repeats, device=args.device, light_fraction=args.light_fraction,
                       progress=lambda message: print(message, file=sys.stderr))
    print_and_save(table, args.out, settings=cli_settings(args), kind="twin-bench")


def _profile(args) -> None:
    from tqdm import tqdm

    from lab.profile import profile_engine

    bars = []  # the bar starts with the first scenario, once the model has loaded (or failed to, with no bar drawn)

    def step(done, total):
        if not bars:
            bars.append(tqdm(total=total, desc="profiling", unit="scenario", file=sys.stderr))
        bars[0].update(1)

    try:
        profile = profile_engine(args.model, args.device, args.block_size, args.backend, args.repeats,
                                 grid=args.grid, progress=step)
    finally:
        for bar in bars:
            bar.close()
    profile.save(args.out)
    print(f"{len(profile.samples)} step shapes on {profile.device} ({profile.dtype}, {profile.backend}); held-out "
          f"relative error median {profile.holdout_median_rel_error:.1%}, max {profile.holdout_max_rel_error:.1%}; "
          f"wrote {args.out}")
    for name, value in profile.coefficients.items():
        print(f"  {name:<24} {value:.4g}")
    print(f"  {'add_request_s':<24} {profile.add_request_s:.4g}  (per request, between steps)")
    print("per scenario (median measured vs fitted step time):")
    print_and_save(profile.scenario_errors(), None)


def _twin(args) -> None:
    # The twin joins the engine and the simulator, so this one command imports simulator (the lab library does not).
    from lab.engine import EngineConfig
    from lab.profile import Profile, extrapolation_warning
    from simulator.twin import TwinConfig, run_twin, twin_workload

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
                          device=args.device, attention_backend=args.backend, seed=args.seed)
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lab", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    bench = commands.add_parser("bench", help="run a benchmark").add_subparsers(dest="bench", required=True)

    k = bench.add_parser("kernels", help="paged decode attention vs SDPA on contiguous K/V")
    k.add_argument("--device", type=device, default="cpu", help="cpu or cuda[:N]")
    k.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"], help="of Q, K and V")
    k.add_argument("--batch", type=positive_ints, default=(1, 8, 32), help="comma list of batch sizes")
    k.add_argument("--context", type=positive_ints, default=(512, 1024), help="comma list of context lengths")
    k.add_argument("--block-size", type=positive_ints, default=(16,),
                   help="comma list of tokens per KV block (several give the simulator its block-size curve)")
    k.add_argument("--backends", default="torch", help="comma list of torch,cupy,reference")
    k.add_argument("--repeats", type=positive_int, default=10, help="timed calls per case (median)")
    k.add_argument("--out", type=output_csv, default="benchmarks/results/kernels_cpu.csv", help="results CSV")
    k.set_defaults(run=_bench_kernels)

    b = bench.add_parser("block-manager", help="block manager operation rates")
    b.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block")
    b.add_argument("--out", type=output_csv, default="benchmarks/results/block_manager.csv", help="results CSV")
    b.set_defaults(run=_bench_block_manager)

    e = bench.add_parser("e2e", help="paged engine vs HF generate vs HF continuous batching")
    _model_options(e, device_default="cpu")
    e.add_argument("--num-requests", type=positive_int, default=64, help="requests queued at once per run")
    e.add_argument("--systems", default="paged-engine,paged-engine-chunked,hf-static,hf-continuous",
                   help="comma list of the systems to run")
    e.add_argument("--repeats", type=positive_int, default=3, help="runs per system; medians are reported")
    e.add_argument("--out", type=output_csv, default="benchmarks/results/e2e_cpu.csv", help="results CSV")
    e.set_defaults(run=_bench_e2e)

    w = bench.add_parser("twin", help="fidelity of the simulator on the engine's profile (saturated, light, chunked)")
    w.add_argument("--models", default="tiny,qwen3-0.6b-random-4l", help="comma-separated presets (see BENCH_MODELS)")
    w.add_argument("--light-fraction", type=positive_float, default=None,
                   help="light load = this fraction of the saturated run's request throughput; default: the model's")
    w.add_argument("--repeats", type=positive_int, default=None,
                   help="profile rounds and real runs per load (median; spread = noise floor); default: the model's")
    w.add_argument("--device", type=device, default=None, help=DEVICE_HELP)
    w.add_argument("--out", type=output_csv, default="benchmarks/results/twin_cpu.csv", help="results CSV")
    w.set_defaults(run=_bench_twin)

    h = commands.add_parser("headlines", help="the headline figures from benchmarks/results/ against their goals "
                                              "(the README's table, as Markdown)")
    h.set_defaults(run=_headlines)

    g = commands.add_parser("generate", help="generate with the paged engine")
    _model_options(g)
    g.add_argument("--prompt", action="append", help="text (with a tokenizer) or comma-separated token ids")
    g.add_argument("--num-prompts", type=positive_int, default=None,
                   help="random prompts when --prompt is not given (default 8)")
    g.add_argument("--prompt-len", type=positive_int, default=None, help="tokens of each random prompt (default 64)")
    g.add_argument("--max-tokens", type=positive_int, default=32, help="tokens to generate per sample")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-k", type=non_negative_int, default=0, help="0: off")
    g.add_argument("--top-p", type=float, default=1.0, help="1: off")
    g.add_argument("--n", type=positive_int, default=1, help="parallel samples per prompt (copy-on-write)")
    g.add_argument("--seed", type=non_negative_int, default=0, help="seeds the random prompts and the sampling")
    g.add_argument("--num-blocks", type=positive_int, default=None,
                   help="KV pool in blocks (default: sized from memory)")
    g.add_argument("--no-prefix-caching", action="store_true", help="no reuse of cached prompt blocks")
    _serving_options(g)
    g.add_argument("--out", type=output_csv, default=None, help="CSV of the run metrics")
    g.set_defaults(run=_generate)

    p = commands.add_parser("profile", help="time real engine steps and fit the simulator's step-time model")
    _model_options(p)
    p.add_argument("--repeats", type=positive_int, default=3, help="measured rounds per scenario (means)")
    p.add_argument("--grid", choices=GRIDS, default="full",
                   help="scenarios: full; small (models whose prefills take seconds on a CPU); quick")
    p.add_argument("--out", type=output_csv, default="profile.json", help="the profile (JSON)")
    p.set_defaults(run=_profile)

    t = commands.add_parser("twin", help="one workload through the engine and the simulator on its profile")
    _model_options(t)
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
    _serving_options(t)
    t.add_argument("--repeats", type=positive_int, default=1, help="real runs (2+: the noise floor)")
    t.add_argument("--seed", type=non_negative_int, default=0, help="seeds the workload, prompts and engine")
    t.add_argument("--out", type=output_csv, default=None, help="CSV: metric, real, simulated, rel_error")
    t.add_argument("--steps-out", type=output_csv, default=None,
                   help="CSV of the real run's steps with each step's modelled time beside its measured one")
    t.set_defaults(run=_twin)
    return parser


DEVICE_HELP = "cpu or cuda[:N] (default: cuda when there is one)"


def _model_options(parser: argparse.ArgumentParser, device_default: str | None = None) -> None:
    """The model and where it runs: --model, --device, --block-size, --backend."""
    parser.add_argument("--model", default="tiny", help="preset or local Qwen3 checkpoint directory")
    parser.add_argument("--device", type=device, default=device_default, help=DEVICE_HELP)
    parser.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block")
    parser.add_argument("--backend", default="auto", help="attention backend: auto, torch, cupy or reference")


def _serving_options(parser: argparse.ArgumentParser) -> None:
    """The scheduler's modes and caps, and the host pool for swapping."""
    parser.add_argument("--scheduling", default="prefill-first", choices=["prefill-first", "chunked"],
                        help="chunked: decodes first, then prompt chunks up to the token budget")
    parser.add_argument("--max-num-seqs", type=positive_int, default=64,
                        help="most sequences running at once (continuous batching's cap)")
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=4096, help="token budget per step")
    parser.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"],
                        help="swap: preempted sequences move to a host pool")
    parser.add_argument("--num-cpu-blocks", type=non_negative_int, default=0,
                        help="host pool for swap (0: as large as the GPU pool, at most vLLM's default 4 GiB "
                             "of swap space)")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _token_ids(text: str) -> list[int]:
    """``--prompt`` for a model without a tokenizer: comma-separated token ids."""
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise InputError(f"--prompt {text!r}: this model has no tokenizer; give comma-separated token ids") from None
