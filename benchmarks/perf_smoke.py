"""``python -m benchmarks.perf_smoke``: a minute at most, in CI, to catch a 2x slowdown of a measured path that no
timed test would see. Ratios only, each measured in this run, alternating subject and baseline (the machine's speed
drifts): the simulator's paged replay against contiguous-oracle on a trace sample, the paged engine against HF
continuous batching on the tiny model, and the Memory simulator's default comparison's paged run against its
contiguous-oracle run. Each ratio must stay above a floor set at about half of what this code measures on the
2-core machine (docs/benchmarks.md), so noise passes and a 2x slowdown does not. Public API only: the same script
runs on older commits (it fails on 6d463e2, whose paged replay was 5x slower). Exit status 1 when a floor is missed.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

AZURE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv"
FLOORS = {"simulator paged / contiguous-oracle speed": 0.33, "paged engine / HF continuous batching output tokens/s": 2.0,
          "default comparison: paged / contiguous-oracle speed": 0.2}


def _alternate(subject, baseline, pairs: int) -> float:
    """Median over ``pairs`` of baseline seconds / subject seconds, the order alternating."""
    ratios = []
    for pair in range(pairs):
        times = {}
        for name in (("subject", "baseline") if pair % 2 == 0 else ("baseline", "subject")):
            started = time.perf_counter()
            (subject if name == "subject" else baseline)()
            times[name] = time.perf_counter() - started
        ratios.append(times["baseline"] / times["subject"])
    return statistics.median(ratios)


def simulator_ratio(rows: int, pairs: int, trace: Path = AZURE) -> tuple[float, str]:
    from simulator import SimConfig, Simulator, load_trace, make_workload

    if trace.is_file():
        workload, source = load_trace(trace, max_rows=rows), f"Azure conversation trace, first {rows:,} requests"
    else:
        workload, source = make_workload("sharegpt", num_requests=rows, rate=40.0), f"sharegpt, {rows:,} requests"
    paged, oracle = (SimConfig(allocator=allocator, block_size=16, model="qwen3-8b", gpu="a100-80gb",
                               max_model_len=16384) for allocator in ("paged", "contiguous-oracle"))
    ratio = _alternate(lambda: Simulator(workload, paged).run(), lambda: Simulator(workload, oracle).run(), pairs)
    return ratio, source


def engine_ratio(requests: int, pairs: int) -> tuple[float, str]:
    import torch

    from lab.bench.e2e import run_hf_continuous, run_paged_engine
    from lab.engine import LLMEngine

    torch.set_num_threads(1)  # both engines alike; a 2-core machine's second core is the harness's
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1000, (int(n),), generator=generator).tolist()
               for n in torch.randint(16, 128, (requests,), generator=generator)]
    outputs = [int(n) for n in torch.randint(16, 64, (requests,), generator=generator)]
    template = LLMEngine("tiny", num_blocks=requests * 16 + 64)
    tokens = {}

    def paged():
        tokens["paged"] = run_paged_engine(template, prompts, outputs)["output_tokens"]

    def hf():
        tokens["hf"] = run_hf_continuous(template.hf_model, prompts, outputs)["output_tokens"]

    ratio = _alternate(paged, hf, pairs)  # equal output tokens: the time ratio is the tokens/s ratio
    assert tokens["paged"] == tokens["hf"] == sum(outputs), tokens
    return ratio, f"tiny Qwen3, {requests} requests"


def compare_ratio(pairs: int) -> tuple[float, str]:
    import simulator

    if hasattr(simulator, "default_inputs"):
        workload, configs = simulator.default_inputs()
    else:  # before the page's defaults had one place
        workload = simulator.make_workload("sharegpt", num_requests=1000, rate=5.0, max_model_len=2048)
        configs = simulator.make_configs(["paged", "contiguous-oracle"], [16], model="opt-13b", gpu="a100-40gb")
    paged = next(c for c in configs if c.allocator == "paged")
    oracle = next(c for c in configs if c.allocator == "contiguous-oracle")
    ratio = _alternate(lambda: simulator.compare(workload, [paged]), lambda: simulator.compare(workload, [oracle]),
                       pairs)
    return ratio, "the Memory simulator's default workload"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.perf_smoke", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8000, help="trace requests replayed")
    parser.add_argument("--requests", type=int, default=16, help="requests of the engine comparison")
    parser.add_argument("--pairs", type=int, default=3, help="alternating pairs per ratio (median)")
    parser.add_argument("--trace", type=Path, default=AZURE,
                        help="the Azure conversation trace (absent: a synthetic ShareGPT workload instead)")
    args = parser.parse_args(argv)
    measured = {"simulator paged / contiguous-oracle speed": simulator_ratio(args.rows, args.pairs, args.trace),
                "paged engine / HF continuous batching output tokens/s": engine_ratio(args.requests, args.pairs),
                "default comparison: paged / contiguous-oracle speed": compare_ratio(args.pairs)}
    missed = 0
    for name, (ratio, source) in measured.items():
        ok = ratio >= FLOORS[name]
        missed += not ok
        print(f"{'ok  ' if ok else 'SLOW'} {name}: {ratio:.3f} (floor {FLOORS[name]}; {source}, median of "
              f"{args.pairs} alternating pairs)")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
