"""``python -m lab``: benchmarks and generation from the command line."""
from __future__ import annotations

import argparse
import sys

import pandas as pd

from lab.errors import InputError
from lab.cli.args import (batch_contexts, cli_settings, device, model_options, non_negative_int, output_csv, output_file,
                          output_folder, positive_int, positive_ints, refuse_ignored, refuse_shared_outputs, run_command, scheduler_options,
                          scheduling_settings, token_ids, TOKEN_IDS)
from lab.models.qwen3 import PRESETS
from lab.profiling.profile import GRIDS
from lab.report.results import csv_target, print_and_save, save_csv, settings_of


def _bench_kernels(args) -> None:
    import torch
    from tqdm import tqdm

    from lab.bench.kernels import KernelBenchConfig, run_kernel_bench

    import pandas as pd

    dtypes = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    if args.shapes:
        refuse_ignored([name for name, default in (("batch", (1, 8, 32)), ("context", (512, 1024)))
                        if tuple(getattr(args, name)) != default], "--shapes gives the batch x context pairs")
    settings = cli_settings(args)
    out = str(csv_target(args.out, settings, "kernels")) if args.out else None  # rows saved as measured
    shapes = len(args.shapes) or len(args.batch) * len(args.context)
    bar = tqdm(total=len(args.block_size) * shapes, desc="kernel bench",
               file=sys.stderr)
    tables = []
    for block_size in args.block_size:  # several: the simulator reads the slowdown per block size from the CSV
        config = KernelBenchConfig(device=args.device, dtype=dtypes[args.dtype], batch_sizes=args.batch,
                                   context_lens=args.context, block_size=block_size,
                                   backends=tuple(args.backends.split(",")), repeats=args.repeats,
                                   shapes=args.shapes, back_to_back=args.back_to_back)
        tables.append(run_kernel_bench(config, progress=lambda done, total: bar.update(1),
                                       on_rows=lambda rows: save_csv(pd.concat([*tables, rows]), out, settings)))
    bar.close()
    print_and_save(pd.concat(tables, ignore_index=True), out, settings=settings, kind="kernels")


def _bench_launches(args) -> None:
    from lab.bench.launches import LedgerConfig, count_launches, launch_summary

    config = LedgerConfig(model=args.model, batch=args.batch, context=args.context, block_size=args.block_size)
    ledger = count_launches(config)
    decode = ledger[(ledger["step"] == "decode") & (ledger["layer"] == 0)]
    print("decode step, one decoder layer:")
    print(decode[["kind", "launches"]].to_string(index=False))
    print_and_save(launch_summary(config, args.host_model), args.out, settings=cli_settings(args), kind="launches")


def _bench_decode(args) -> None:
    from lab.bench.decode import DecodeBenchConfig, run_decode_bench

    config = DecodeBenchConfig(model=args.model, device=args.device, batches=args.batch, contexts=args.context,
                               block_size=args.block_size, attention_backend=args.backend, steps=args.steps)
    settings = cli_settings(args)
    out = str(csv_target(args.out, settings, "decode")) if args.out else None  # one file, however many rows
    # each row is saved as it is measured: a case that crashes the process loses only itself
    table = run_decode_bench(config, on_row=lambda rows: save_csv(rows, out, settings, "decode"))
    print_and_save(table, out, settings=settings, kind="decode")


def _bench_kv_precision(args) -> None:
    from lab.bench.kv_precision import KVPrecisionBenchConfig, run_kv_precision_bench

    config = KVPrecisionBenchConfig(models=tuple(args.model), dtype=args.dtype,
                                    kv_cache_dtypes=tuple(args.kv_cache_dtype), num_prompts=args.num_prompts,
                                    prompt_len=args.prompt_len, max_tokens=args.max_tokens,
                                    tie_margin=args.tie_margin)
    settings = {k: v for k, v in settings_of(config).items() if k not in ("models", "kv_cache_dtypes")}
    out = str(csv_target(args.out, settings, "kv_precision")) if args.out else None
    table = run_kv_precision_bench(config, on_row=lambda rows: save_csv(rows, out, settings, "kv_precision"))
    print_and_save(table, out, settings=settings, kind="kv_precision")


def _bench_parity(args) -> None:
    from lab.bench.parity import ParityConfig, run_parity

    config = ParityConfig(model=args.model, device=args.device, attention_backend=args.backend,
                          num_prompts=args.num_prompts, max_tokens=args.max_tokens)
    settings = cli_settings(args)
    out = str(csv_target(args.out, settings, "parity")) if args.out else None
    table = run_parity(config, on_row=lambda rows: save_csv(rows, out, settings, "parity"))
    print_and_save(table, out, settings=settings, kind="parity")


def _headlines(args) -> None:
    from lab.report.results import headline_markdown

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


def _bench_contention(args) -> None:
    from tqdm import tqdm

    from lab.bench.contention import ContentionConfig, run_contention_bench

    config = ContentionConfig(model=args.model, num_requests=args.num_requests, repeats=args.repeats)
    bar = tqdm(total=1, desc="contention bench", file=sys.stderr)
    table = run_contention_bench(config, progress=lambda done, total: (setattr(bar, "total", total),
                                                                       bar.update(done - bar.n)))
    bar.close()
    print_and_save(table, args.out, settings=settings_of(config), kind="contention")


def _comma_list(text: str) -> list[str]:
    values = [v for v in text.split(",") if v]
    if not values:
        raise argparse.ArgumentTypeError(f"expected a comma list, got {text!r}")
    return values


def vllm_models(text: str) -> list[str]:
    """``--model`` of ``bench vllm``: presets vLLM's CPU attention takes (head_dim 32 or 128)."""
    models = [m for m in text.split(",") if m]
    allowed = ("tiny", "qwen3-0.6b-random-4l")
    if not models or any(m not in allowed for m in models):
        raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(allowed)}; got {text!r}")
    return models


VLLM_BENCH_OUT = "benchmarks/results/vllm_cpu.csv"


def _bench_vllm(args) -> None:
    from tqdm import tqdm

    from lab.bench.vllm import FIXED_REPEATS, VLLMBenchConfig, run_vllm_bench

    if args.profile:
        if args.workload == "random" or args.seed is not None or args.family is not None or args.background_load \
                or args.first_token_only:
            raise InputError("--profile times fixed step shapes: --workload random, --seed, --family, "
                             "--background-load and --first-token-only do not apply")
        _profile_vllm(args)
        return
    if args.workload == "random":
        if args.first_token_only:
            raise InputError("--first-token-only with --workload random: the family compares full-precision "
                             "caches; run the fixed workload for FP8")
        _bench_vllm_family(args)
        return
    if args.seed is not None or args.family is not None:
        raise InputError("--seed and --family draw a family of workloads: they go with --workload random")
    if len(args.num_requests) != len(args.model):
        raise InputError(f"--num-requests gives {len(args.num_requests)} counts for {len(args.model)} models")
    if args.first_token_only and (args.kv_cache_dtype == "auto" or args.background_load):
        raise InputError("--first-token-only measures the FP8 first-token agreement: it needs an FP8 "
                         "--kv-cache-dtype and no --background-load")
    tables = []
    for model, requests in zip(args.model, args.num_requests):
        first_token_only = dict(repeats=1, output_range=(1, 1)) if args.first_token_only else \
            dict(repeats=args.repeats or FIXED_REPEATS)
        config = VLLMBenchConfig(model=model, dtype=args.dtype, num_requests=requests, num_blocks=args.num_blocks,
                                 kv_cache_dtype=args.kv_cache_dtype, tie_margin=args.tie_margin,
                                 background_load=args.background_load, **first_token_only)
        bar = tqdm(total=2 * config.repeats, desc=f"ours vs vLLM, {model}", file=sys.stderr)
        tables.append(run_vllm_bench(config, progress=lambda done, total: bar.update(done - bar.n)))
        bar.close()
    shared = {k: v for k, v in settings_of(config).items() if k not in ("model", "num_requests")}  # per-row columns
    print_and_save(pd.concat(tables, ignore_index=True), _vllm_bench_out(args), settings=shared, kind="vllm")


def _vllm_bench_out(args) -> str:
    """``--out``, or where the default goes for this precision and load: the fp32 figures stay in
    ``VLLM_BENCH_OUT``, bf16's, FP8's and the background load's files of their own (the README's rows read each)."""
    if args.out != VLLM_BENCH_OUT:
        return args.out
    if args.kv_cache_dtype != "auto":
        return ("benchmarks/results/vllm_fp8_agreement_cpu.csv" if args.first_token_only else
                "benchmarks/results/vllm_fp8_cpu.csv")
    if args.background_load:  # its own file: the quiet-only figures of vllm_cpu.csv stay
        return "benchmarks/results/vllm_contention_cpu.csv"
    return "benchmarks/results/vllm_cpu_bf16.csv" if args.dtype == "bfloat16" else VLLM_BENCH_OUT


def _bench_vllm_family(args) -> None:
    from tqdm import tqdm

    from lab.bench.vllm import FAMILY_REPEATS
    from lab.bench.vllm_family import run_family_bench

    if args.num_requests != (32, 16) or args.num_blocks != 512:
        raise InputError("--num-requests and --num-blocks size the fixed workload; a random family draws its own "
                         "(the pool is 16,384 tokens at every block size)")
    if args.background_load:
        raise InputError("--background-load with --workload random: the contention figures use the fixed workload")
    if args.kv_cache_dtype != "auto":
        raise InputError("--kv-cache-dtype with --workload random: the family compares full-precision caches; run "
                         "the fixed workload for FP8")
    seed, count = args.seed if args.seed is not None else 0, args.family or 8
    tables = []
    for model in args.model:
        bar = tqdm(total=1, desc=f"ours vs vLLM, {model}, random family", file=sys.stderr)
        tables.append(run_family_bench(model, (args.dtype,), seed, count, args.repeats or FAMILY_REPEATS,
                                       progress=lambda done, total: (setattr(bar, "total", total),
                                                                     bar.update(done - bar.n))))
        bar.close()
    out = args.out if args.out != VLLM_BENCH_OUT else f"benchmarks/results/vllm_family_{args.dtype}_cpu.csv"
    print_and_save(pd.concat(tables, ignore_index=True), out,
                   settings={"dtype": args.dtype, "family_seed": seed, "family_size": count}, kind="vllm-family")


def _profile_vllm(args) -> None:
    from tqdm import tqdm

    from lab.bench.step_profile import run_step_profile

    tables = []
    for model in args.model:
        bar = tqdm(desc=f"step shapes, ours and vLLM, {model}", file=sys.stderr)
        tables.append(run_step_profile(model, args.dtype, progress=lambda done, total: bar.update(done - bar.n)))
        bar.close()
    out = args.out if args.out != VLLM_BENCH_OUT else "benchmarks/results/vllm_profile_cpu.csv"
    print_and_save(pd.concat(tables, ignore_index=True), out, settings={"dtype": args.dtype}, kind="vllm-profile")


def _generate(args) -> None:
    import torch

    from lab.engine import LLMEngine, SamplingParams

    given = (args.prompt or []) + (args.prompt_ids or [])
    if given:
        refuse_ignored([name for name in ("num_prompts", "prompt_len") if getattr(args, name) is not None],
                       "they shape random prompts, and --prompt or --prompt-ids gives them")
    refuse_shared_outputs(args, "out", inputs=[("the checkpoint", args.model)])
    if args.temperature == 0:
        refuse_ignored([name for name, default in (("top_k", 0), ("top_p", 1.0)) if getattr(args, name) != default]
                       + (["seed"] if given and args.seed != 0 else []),
                       "greedy decoding (--temperature 0) takes the most likely token: they shape sampling (and "
                       "--seed the random prompts, which --prompt replaces)")
    engine = LLMEngine(args.model, block_size=args.block_size, num_blocks=args.num_blocks, device=args.device,
                       attention_backend=args.backend, enable_prefix_caching=not args.no_prefix_caching,
                       kv_cache_dtype=args.kv_cache_dtype, calculate_kv_scales=args.calculate_kv_scales,
                       **scheduling_settings(args))
    if given:
        prompts = [_text_prompt(p, engine.tokenizer is not None) for p in args.prompt or []] + (args.prompt_ids or [])
    else:
        generator = torch.Generator().manual_seed(args.seed)
        vocab = engine.hf_model.config.vocab_size
        prompts = [torch.randint(0, vocab, (args.prompt_len or 64,), generator=generator).tolist()
                   for _ in range(args.num_prompts or 8)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, n=args.n)
    for output in engine.generate(prompts, params, progress=True):
        samples = output.texts if output.texts is not None else output.outputs
        for index, sample in enumerate(samples):  # every sample of --n, as [request] or [request.sample]
            print(f"[{output.request_id}{f'.{index}' if len(samples) > 1 else ''}] {sample}")
    metrics = pd.DataFrame([engine.run_metrics()])
    print_and_save(metrics, args.out, settings=cli_settings(args), kind="generate")


def _profile(args) -> None:
    from tqdm import tqdm

    from lab.profiling.profile import profile_engine

    refuse_shared_outputs(args, "out", inputs=[("the checkpoint", args.model)])
    if args.peer == "vllm":
        return _profile_peer(args)
    refuse_ignored([name for name, default in (("num_blocks", 256), ("max_num_seqs", 16),
                                               ("max_num_batched_tokens", 512)) if getattr(args, name) != default],
                   "they size vLLM's engine, for --peer vllm; the engine profiled here takes its own")
    args.block_size = args.block_size or 16
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
    _report_profile(profile, args.out)


def _profile_peer(args) -> None:
    import tempfile

    import torch
    from tqdm import tqdm

    from lab.models.qwen3 import checkpoint_dir, checkpoint_vocab_size
    from lab.peer.client import PeerSettings, VLLMPeer
    from lab.peer.profiling import profile_vllm

    refuse_ignored([name for name, default in (("device", None), ("backend", "auto"))
                    if getattr(args, name) != default], "vLLM's CPU build runs on the CPU with its own attention")
    block_size = args.block_size or 32
    if block_size % 32:
        raise InputError(f"--block-size {block_size}: vLLM's CPU attention takes multiples of 32")
    with tempfile.TemporaryDirectory(prefix="minipaged-profile-") as folder:
        checkpoint = checkpoint_dir(args.model, folder, torch.float32)
        settings = PeerSettings(checkpoint, block_size=block_size, num_blocks=args.num_blocks,
                                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                enable_prefix_caching=True)
        vocab = checkpoint_vocab_size(checkpoint)
        with VLLMPeer(settings) as peer, tqdm(desc="profiling vLLM", unit="scenario", file=sys.stderr) as bar:
            profile = profile_vllm(peer, args.model, vocab, args.grid, args.repeats,
                                   progress=lambda done, total: (setattr(bar, "total", total), bar.update(1)))
    _report_profile(profile, args.out)


def _report_profile(profile, out: str) -> None:
    profile.save(out)
    print(f"{len(profile.samples)} step shapes on {profile.device} ({profile.dtype}, {profile.backend}); held-out "
          f"relative error median {profile.holdout_median_rel_error:.1%}, max {profile.holdout_max_rel_error:.1%}; "
          f"wrote {out}")
    for name, value in profile.coefficients.items():
        print(f"  {name:<24} {value:.4g}")
    print(f"  {'add_request_s':<24} {profile.add_request_s:.4g}  (per request, between steps)")
    print("per scenario (median measured vs fitted step time):")
    print_and_save(profile.scenario_errors(), None)


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
    k.add_argument("--repeats", type=positive_int, default=10, help="timed samples per case (median)")
    k.add_argument("--shapes", type=batch_contexts, default=(),
                   help="comma list of BATCHxCONTEXT pairs (e.g. 64x512,8x32768) instead of every --batch x --context")
    k.add_argument("--back-to-back", type=positive_int, default=1,
                   help="calls per timed sample, between two clock reads (CUDA events on a GPU)")
    k.add_argument("--out", type=output_csv, default="benchmarks/results/kernels_cpu.csv", help="results CSV")
    k.set_defaults(run=_bench_kernels)

    b = bench.add_parser("block-manager", help="block manager operation rates")
    b.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block")
    b.add_argument("--out", type=output_csv, default="benchmarks/results/block_manager.csv", help="results CSV")
    b.set_defaults(run=_bench_block_manager)

    e = bench.add_parser("e2e", help="paged engine vs HF generate vs HF continuous batching")
    model_options(e, device_default="cpu")
    e.add_argument("--num-requests", type=positive_int, default=64, help="requests queued at once per run")
    e.add_argument("--systems", default="paged-engine,paged-engine-chunked,hf-static,hf-continuous",
                   help="comma list of the systems to run")
    e.add_argument("--repeats", type=positive_int, default=3, help="runs per system; medians are reported")
    e.add_argument("--out", type=output_csv, default="benchmarks/results/e2e_cpu.csv", help="results CSV")
    e.set_defaults(run=_bench_e2e)

    c = bench.add_parser("contention", help="the paged engine (each thread policy) and HF continuous batching, quiet "
                                            "and with one core kept busy, alternating: slowdowns and ratios")
    c.add_argument("--model", default="tiny", help="preset or local Qwen3 checkpoint directory")
    c.add_argument("--num-requests", type=positive_int, default=32, help="requests queued at once per run")
    c.add_argument("--repeats", type=positive_int, default=3, help="runs per system and load; medians are reported")
    c.add_argument("--out", type=output_csv, default="benchmarks/results/contention_cpu.csv", help="results CSV")
    c.set_defaults(run=_bench_contention)

    v = bench.add_parser("vllm", help="our engine vs vLLM's CPU build on the same checkpoint, pool and budgets "
                                      "(runs alternating; needs `bash scripts/vllm_peer.sh`)")
    v.add_argument("--model", type=vllm_models, default=["tiny", "qwen3-0.6b-random-4l"],
                   help="comma list of presets, each saved as a checkpoint both engines load")
    v.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="both engines' dtype")
    v.add_argument("--num-requests", type=positive_ints, default=(32, 16),
                   help="requests per model, in --model's order (prompts of 100-400 tokens, 80-120 out)")
    v.add_argument("--num-blocks", type=positive_int, default=512, help="vLLM's KV blocks of 32 tokens (ours: one "
                                                                          "fewer, vLLM's null block)")
    v.add_argument("--repeats", type=positive_int, default=None,
                   help="alternating runs of each engine (medians; default 5 on the fixed workload, where vLLM's own "
                        "TTFT p50 moved 30-44 ms between runs of 3, and 3 a workload in a random family)")
    v.add_argument("--workload", choices=["fixed", "random"], default="fixed",
                   help="fixed: the bench's workload; random: a seeded family of workloads it did not choose "
                        "(8-64 requests, prompts 16-1,000, outputs 16-256, staggered or not, block 32/64/128, "
                        "prefix caching on or off), with the family's median and worst ratio")
    v.add_argument("--background-load", action="store_true",
                   help="each repeat also with one core kept busy by a pinned process: both engines' slowdown")
    v.add_argument("--seed", type=non_negative_int, default=None, help="the random family's seed (default 0)")
    v.add_argument("--family", type=positive_int, default=None, help="workloads in the random family (default 8)")
    v.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
                   help="both engines' KV cache (vLLM's CPU build stores FP8 as uint8 and needs AVX-512 or AMX)")
    v.add_argument("--tie-margin", type=float, default=0.5,
                   help="with FP8: first tokens whose top-2 logit margin on our full-precision cache is below this "
                        "are near ties, left out of first_token_agreement_clear")
    v.add_argument("--first-token-only", action="store_true",
                   help="with FP8: one output token per request and one run, so the first-token agreements can be "
                        "measured on many prompts (the speed columns then time one-token requests; default --out "
                        "benchmarks/results/vllm_fp8_agreement_cpu.csv)")
    v.add_argument("--profile", action="store_true",
                   help="instead: where a step's time goes in both engines, by op kind, on fixed step shapes "
                        "(prefills of 32-2,048 tokens, decodes of 1-64 sequences at 128 and 1,024 tokens)")
    v.add_argument("--out", type=output_csv, default=VLLM_BENCH_OUT,
                   help="results CSV (with --profile: benchmarks/results/vllm_profile_cpu.csv, with an FP8 "
                        "--kv-cache-dtype: benchmarks/results/vllm_fp8_cpu.csv, with --dtype bfloat16: "
                        "benchmarks/results/vllm_cpu_bf16.csv, unless given)")
    v.set_defaults(run=_bench_vllm)

    n = bench.add_parser("launches", help="kernel launches per layer and step of the CUDA path (counted on the "
                                          "meta device) and the host's time per step outside the forward")
    n.add_argument("--model", default="qwen3-0.6b-random", help="preset whose shapes are counted")
    n.add_argument("--batch", type=positive_int, default=64, help="sequences of the decode step")
    n.add_argument("--context", type=positive_int, default=512, help="tokens each decode sequence attends to")
    n.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block")
    n.add_argument("--host-model", default="tiny", help="the model a real CPU engine times the host path with")
    n.add_argument("--out", type=output_csv, default="benchmarks/results/launches.csv", help="results CSV")
    n.set_defaults(run=_bench_launches)

    q = bench.add_parser("parity", help="the engine against HF on one device: fp32 greedy tokens with CUDA graphs "
                                        "off and on, bf16 first-step logits")
    model_options(q, device_default="cpu")
    q.add_argument("--num-prompts", type=positive_int, default=8, help="prompts of 16-96 random tokens")
    q.add_argument("--max-tokens", type=positive_int, default=32, help="greedy tokens per prompt")
    q.add_argument("--out", type=output_csv, default="benchmarks/results/parity.csv", help="results CSV")
    q.set_defaults(run=_bench_parity)

    p = bench.add_parser("kv-precision", help="FP8 KV cache against a full-precision one, teacher-forced: attention "
                                              "output and logits relative error, top-1 agreement (docs/fp8.md)")
    p.add_argument("--model", type=_comma_list, default=["tiny", "qwen3-0.6b-random"], help="comma list of presets")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the model's and the baseline cache's dtype")
    p.add_argument("--kv-cache-dtype", type=_comma_list, default=["fp8_e4m3", "fp8_e5m2"],
                   help="comma list of FP8 formats (each with scale 1.0 and calculated scales)")
    p.add_argument("--num-prompts", type=positive_int, default=4, help="prompts of random tokens")
    p.add_argument("--prompt-len", type=positive_int, default=48, help="tokens per prompt")
    p.add_argument("--max-tokens", type=positive_int, default=16, help="greedy tokens per prompt")
    p.add_argument("--tie-margin", type=float, default=0.1,
                   help="baseline top-2 logit margin below which a position counts as a near tie")
    p.add_argument("--out", type=output_csv, default="benchmarks/results/kv_precision_cpu.csv", help="results CSV")
    p.set_defaults(run=_bench_kv_precision)

    d = bench.add_parser("decode", help="decode step time per batch and context, with and without CUDA graphs")
    model_options(d, device_default="cpu")
    d.add_argument("--batch", type=positive_ints, default=(1, 8, 64), help="comma list of decode batch sizes")
    d.add_argument("--context", type=positive_ints, default=(512, 4096), help="comma list of context lengths")
    d.add_argument("--steps", type=positive_int, default=20, help="decode steps timed per case (median)")
    d.add_argument("--out", type=output_csv, default="benchmarks/results/decode_cpu.csv", help="results CSV")
    d.set_defaults(run=_bench_decode)

    h = commands.add_parser("headlines", help="the headline figures from benchmarks/results/ against their goals "
                                              "(the README's table, as Markdown)")
    h.set_defaults(run=_headlines)

    g = commands.add_parser("generate", help="generate with the paged engine")
    model_options(g)
    g.add_argument("--prompt", action="append",
                   help="text (with a tokenizer; ids look-alikes are read as text, with a note) or, for a model "
                        "without one, comma-separated token ids")
    g.add_argument("--prompt-ids", action="append", type=token_ids,
                   help="comma-separated token ids, with or without a tokenizer (after the --prompt ones)")
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
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
                   help="KV cache element type, vLLM's names: auto (the model's dtype) or FP8, one byte an element "
                        "(docs/fp8.md)")
    g.add_argument("--calculate-kv-scales", action="store_true",
                   help="FP8: each layer's k/v scales from the first prefill (vLLM's calculate_kv_scales; "
                        "default: 1.0)")
    scheduler_options(g)
    g.add_argument("--out", type=output_csv, default=None, help="CSV of the run metrics")
    g.set_defaults(run=_generate)

    p = commands.add_parser("profile", help="time real engine steps and fit the simulator's step-time model")
    model_options(p)
    p.add_argument("--repeats", type=positive_int, default=3, help="measured rounds per scenario (means)")
    p.add_argument("--grid", choices=GRIDS, default="full",
                   help="scenarios: full; small (models whose prefills take seconds on a CPU); quick")
    p.add_argument("--out", type=output_csv, default="profile.json", help="the profile (JSON)")
    p.add_argument("--peer", choices=["vllm"], default=None,
                   help="measure vLLM's engine (the peer environment) instead of ours, on the scenarios it runs as "
                        "they are; its block size defaults to 32 (multiples of 32 only)")
    p.add_argument("--num-blocks", type=positive_int, default=256, help="--peer vllm: vLLM's KV pool in blocks")
    p.add_argument("--max-num-seqs", type=positive_int, default=16, help="--peer vllm: vLLM's running cap")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=512, help="--peer vllm: its token budget")
    p.set_defaults(run=_profile, block_size=None)

    c = commands.add_parser("checkpoint", help="save a preset as a Hugging Face checkpoint directory (weights, config "
                                               "and a tokenizer built here) that our engine, HF and vLLM all load")
    c.add_argument("--model", default="tiny", choices=list(PRESETS), help="preset (random weights, seeded)")
    c.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="weights' dtype")
    c.add_argument("--seed", type=non_negative_int, default=0, help="seeds the random weights (as the engine does)")
    c.add_argument("--out", type=output_folder, required=True, help="the checkpoint directory")
    c.set_defaults(run=_checkpoint)

    f = commands.add_parser("peer", help="the vLLM peer (needs `bash scripts/vllm_peer.sh`)").add_subparsers(
        dest="peer", required=True).add_parser(
        "fuzz", help="differential testing of the vllm policy against vLLM on seeded random workloads under pool "
                     "pressure; every difference shrunk (exit status 1 when any differs)")
    f.add_argument("--runs", type=positive_int, default=200, help="workloads, spread over six pool shapes")
    f.add_argument("--seed", type=non_negative_int, default=0, help="seeds the workloads")
    f.add_argument("--shrink-budget", type=positive_int, default=40, help="most runs spent shrinking one difference")
    f.add_argument("--out", type=output_file, default=None, help="JSON of the shrunk differing cases")
    f.set_defaults(run=_peer_fuzz)

    return parser


def _peer_fuzz(args) -> int:
    import tempfile
    from pathlib import Path

    import torch
    from tqdm import tqdm

    from lab.models.qwen3 import save_checkpoint
    from lab.peer.client import PeerError, missing_reason
    from lab.peer.fuzz import fuzz, save_cases

    if missing_reason() is not None:
        raise PeerError(missing_reason())
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = save_checkpoint("tiny", Path(folder) / "checkpoint", torch.float32)
        bar = tqdm(total=args.runs, desc="workloads, vLLM and ours", file=sys.stderr)
        report = fuzz(str(checkpoint), args.runs, args.seed, shrink_budget=args.shrink_budget,
                      progress=lambda done, total: bar.update(done - bar.n))
        bar.close()
    print(f"{report.workloads} workloads, {report.steps:,} steps, {report.preemptions:,} preemptions (vLLM's): "
          f"{len(report.differing)} differ")
    for case in report.differing:
        sizes = [len(prompt) for prompt in case["workload"]["prompts"]]
        print(f"- {case['name']} ({case['shape']}): {case['found_as']}; shrunk to {len(sizes)} requests "
              f"(prompts {sizes}, outputs {case['workload']['max_tokens']}): {case['difference']}")
    if report.shrinks_bounded:
        print(f"{report.shrinks_bounded} shrinks stopped at their bound of {args.shrink_budget} runs: those cases "
              f"may not be minimal")
    if args.out and report.differing:
        save_cases(report, args.out)
        print(f"saved the shrunk cases to {args.out}")
    return 1 if report.differing else 0


def _checkpoint(args) -> None:
    import torch

    from lab.models.qwen3 import save_checkpoint

    print(save_checkpoint(args.model, args.out, getattr(torch, args.dtype), args.seed))


def main(argv: list[str] | None = None) -> int:
    return run_command(build_parser(), argv)


def _text_prompt(text: str, has_tokenizer: bool) -> str | list[int]:
    """``--prompt``: text for a model with a tokenizer (a note on stderr when it looks like token ids, which it is
    not read as), comma-separated token ids for one without."""
    if has_tokenizer:
        if TOKEN_IDS.fullmatch(text):
            print(f"note: --prompt {text!r} is read as text (this model has a tokenizer); to pass token ids, use "
                  f"--prompt-ids {text.replace(' ', '')}", file=sys.stderr)
        return text
    try:
        return token_ids(text)
    except argparse.ArgumentTypeError:
        raise InputError(f"--prompt {text!r}: this model has no tokenizer; give comma-separated token ids (or use "
                         f"--prompt-ids)") from None
