"""``python -m simulator sweep`` and ``python -m simulator plan``: many simulations as Ray tasks."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lab.cli_args import positive_float, positive_int
from lab.results import print_and_save

from .sweep import GridError, load_grid, run_sweep, save_table


def output_table(text: str) -> str:
    """A ``.parquet`` or ``.csv`` path that can be written (checked before any run)."""
    from lab.cli_args import output_csv

    if Path(text).suffix not in (".parquet", ".csv"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a .parquet or .csv file")
    return output_csv(text)


def sweep_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m simulator sweep",
                                description="Run every combination of a grid of SimConfig fields and workload "
                                            "parameters as Ray tasks; finished runs are kept in a store and skipped "
                                            "when the sweep is run again.")
    p.add_argument("--grid", required=True, help="YAML: field -> list of values")
    p.add_argument("--out", type=output_table, required=True, help="results table (.parquet or .csv)")
    p.add_argument("--store", default=None, help="folder of finished runs (default: <out>.store next to --out)")
    p.add_argument("--address", default=None, help="an existing Ray cluster (default: RAY_ADDRESS, else local)")
    p.add_argument("--num-cpus", type=positive_int, default=None, help="CPUs of the local Ray (default: all)")
    p.add_argument("--serial", action="store_true", help="run in this process, without Ray")
    p.add_argument("--no-progress", action="store_true")
    return p


def sweep_main(argv: list[str]) -> int:
    args = sweep_parser().parse_args(argv)
    store = args.store or str(Path(args.out).with_suffix("")) + ".store"
    try:
        grid = load_grid(args.grid)
        result = run_sweep(grid, store, parallel=not args.serial, address=args.address, num_cpus=args.num_cpus,
                           progress=not args.no_progress)
    except (GridError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    table = result.table
    save_table(table, args.out)
    failed = int((table["error"] != "").sum())
    print(f"{len(table)} runs ({result.ran} run now, {len(table) - result.ran} from {store}); {failed} failed; "
          f"Ray start-up {result.ray_init_s:.1f} s; wrote {args.out}", file=sys.stderr)
    for row in table[table["error"] != ""].head(5).itertuples():
        print(f"warning: run {row.run_key} failed: {row.error}", file=sys.stderr)
    return 1 if failed == len(table) else 0
