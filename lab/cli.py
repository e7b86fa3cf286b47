"""``python -m lab``: benchmarks and generation from the command line."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd


def _print_and_save(table: pd.DataFrame, out: str | None) -> None:
    with pd.option_context("display.width", 200, "display.max_columns", 30, "display.float_format", "{:.4g}".format):
        print(table.to_string(index=False))
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        table.to_csv(out, index=False)
        print(f"wrote {out}")


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _bench_kernels(args) -> None:
    import torch
    from tqdm import tqdm

    from lab.bench.kernels import KernelBenchConfig, run_kernel_bench

    dtypes = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    config = KernelBenchConfig(device=args.device, dtype=dtypes[args.dtype], batch_sizes=args.batch,
                               context_lens=args.context, block_size=args.block_size,
                               backends=tuple(args.backends.split(",")), repeats=args.repeats)
    bar = tqdm(total=len(args.batch) * len(args.context), desc="kernel bench", file=sys.stderr)
    table = run_kernel_bench(config, progress=lambda done, total: bar.update(1))
    bar.close()
    _print_and_save(table, args.out)


def _bench_block_manager(args) -> None:
    from lab.bench.block_manager import run_block_manager_bench

    _print_and_save(run_block_manager_bench(args.block_size), args.out)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lab", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    bench = commands.add_parser("bench", help="run a benchmark").add_subparsers(dest="bench", required=True)

    k = bench.add_parser("kernels", help="paged decode attention vs SDPA on contiguous K/V")
    k.add_argument("--device", default="cpu")
    k.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    k.add_argument("--batch", type=_ints, default=(1, 8, 32))
    k.add_argument("--context", type=_ints, default=(512, 1024))
    k.add_argument("--block-size", type=int, default=16)
    k.add_argument("--backends", default="torch", help="comma list of torch,cupy,reference")
    k.add_argument("--repeats", type=int, default=10)
    k.add_argument("--out", default="benchmarks/results/kernels_cpu.csv")
    k.set_defaults(run=_bench_kernels)

    b = bench.add_parser("block-manager", help="block manager operation rates")
    b.add_argument("--block-size", type=int, default=16)
    b.add_argument("--out", default="benchmarks/results/block_manager.csv")
    b.set_defaults(run=_bench_block_manager)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except (ValueError, RuntimeError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
